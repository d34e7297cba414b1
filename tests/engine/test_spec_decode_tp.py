"""Speculative decoding under tensor parallelism (Gloo on CPU): rank 0 proposes and verifies, the
other rank runs the same verification forward (drafts are extra query tokens in the broadcast step
inputs, their logits rows in `logits_indices`). TP=2 gives TP=1's tokens and logprobs, and both
give the non-speculative engine's tokens, with n-gram and with a draft model (unsharded on rank 0).
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from engine.spec_decode.adaptive import FixedController
from engine.spec_decode.config import SpeculativeConfig
from tests.engine.test_tensor_parallel import LOGPROB_TOLERANCE

SPECS = {"ngram": SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2),
         "draft_model": SpeculativeConfig("draft_model", 3, model="tiny")}


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("CBSERVE_NUM_THREADS", "1")


def _generate(tp: int, spec: SpeculativeConfig | None):
    engine = Engine(EngineConfig(model="tiny", tensor_parallel_size=tp, speculative=spec,
                                 cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    if spec is not None:
        engine.spec.controller = FixedController(spec.num_speculative_tokens)
    try:
        g = torch.Generator().manual_seed(9)
        prompts = [torch.randint(3, 260, (n,), generator=g).tolist() for n in (5, 90, 17)]
        params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True),
                  SamplingParams(max_tokens=12, temperature=0.9, seed=4, ignore_eos=True),
                  SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
        ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params)]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        logprobs: dict[str, list] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                logprobs[out.request_id] += out.new_logprobs
        return [(tokens[i], logprobs[i]) for i in ids], engine.stats().spec_decode
    finally:
        engine.close()


@pytest.mark.parametrize("method", sorted(SPECS))
def test_tp2_with_speculation_equals_tp1_and_the_plain_engine(method):
    plain, _ = _generate(1, None)
    one, stats1 = _generate(1, SPECS[method])
    two, stats2 = _generate(2, SPECS[method])
    assert stats2.num_drafts > 0 and stats2 == stats1        # the same drafts, the same acceptance
    for (want, _), (tokens1, _), (tokens2, _) in zip(plain, one, two):
        assert tokens1 == want and tokens2 == want
    (_, lps0), (_, lps1), (_, lps2) = plain[0], one[0], two[0]
    assert len(lps2) == len(lps0) == 12
    for lp0, lp1, lp2 in zip(lps0, lps1, lps2):
        assert abs(lp1.logprob - lp0.logprob) <= LOGPROB_TOLERANCE
        assert abs(lp2.logprob - lp1.logprob) <= LOGPROB_TOLERANCE
        assert [t for t, _ in lp2.top] == [t for t, _ in lp1.top]
