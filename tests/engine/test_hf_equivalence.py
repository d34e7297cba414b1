"""The correctness anchor: for the same weights, our logits and greedy tokens equal transformers'.

Requests go through chunked prefill with a budget smaller than the prompts, arrive mid-flight,
finish at different times, and share a block pool small enough to force preemption by recompute.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from tests.engine.hf_models import CONFIGS, make_hf_model

NUM_TOKENS = 32


def _record_logits(engine: Engine) -> dict[str, list[torch.Tensor]]:
    """Wraps the sampler so each request's logits are kept per output position."""
    seen: dict[str, list[torch.Tensor]] = {}
    original = engine.sampler.sample_on_device     # what every step samples through

    def sample_on_device(logits, requests, *args, **kwargs):
        for row, req in zip(logits, requests):
            seen.setdefault(req.request_id, []).append(row.clone())
        return original(logits, requests, *args, **kwargs)

    engine.sampler.sample_on_device = sample_on_device
    return seen


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, path)
    return request.param, path, hf


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [37, 5, 64, 18, 50, 23]  # unequal, not multiples of the block size, longer than the budget
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def test_logits_and_greedy_tokens_match_transformers(checkpoint):
    name, path, hf = checkpoint
    # 19 usable blocks of 8 tokens cannot hold all six requests at full length: preemption must happen.
    engine = Engine(EngineConfig(
        model=str(path),
        cache=CacheConfig(block_size=8, num_blocks=20),
        scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4),
    ))
    check_against_transformers(name, engine, hf)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"


def transformers_next_token_logits(hf, prompt: list[int], ours: list[int]) -> torch.Tensor:
    """transformers' next-token logits after `prompt` and each of our tokens but the last, from one
    full forward over prompt + ours."""
    with torch.no_grad():
        return hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1: len(prompt) - 1 + len(ours)].float()


def transformers_greedy(hf, logits: torch.Tensor) -> list[int]:
    """The tokens transformers' greedy `generate(min_new_tokens=len(logits))` picks from those rows
    (end-of-sequence barred, as its min-length processor bars it). Equal to our tokens, it means
    `generate` from the prompt would produce exactly ours, by induction over positions, without its
    token-by-token loop."""
    eos = hf.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    barred = logits.clone()
    barred[:, eos] = float("-inf")
    return barred.argmax(-1).tolist()


def check_against_transformers(name: str, engine: Engine, hf, prompts: list[list[int]] | None = None) -> None:
    """Six greedy requests through `engine` (chunked, arriving mid-flight, finishing at different
    times) are transformers' greedy tokens, and their logits at every sampled position equal one
    full forward of `hf`; every block is free at the end."""
    vocab = hf.config.vocab_size
    prompts = prompts or _prompts(vocab, seed=len(name))
    max_tokens = [NUM_TOKENS, 20, NUM_TOKENS, 9, 27, NUM_TOKENS][:len(prompts)]  # finish at different times
    logits_seen = _record_logits(engine)
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n) for n in max_tokens]

    # Arrivals mid-flight: two requests up front, then one more every third step.
    pending = list(zip(prompts, params))
    ids: list[str] = []
    finished = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and (step == 0 or step % 3 == 0):
            for _ in range(2 if step == 0 else 1):
                if pending:
                    p, sp = pending.pop(0)
                    ids.append(engine.add_request(p, sp).request_id)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.output_token_ids)
        step += 1
        assert step < 2000
    assert engine.stats().kv_cache_usage == 0.0

    for rid, prompt, n in zip(ids, prompts, max_tokens):
        ours = finished[rid]
        assert len(ours) == n
        ref = transformers_next_token_logits(hf, prompt, ours)
        assert transformers_greedy(hf, ref) == ours, f"{name}: greedy tokens differ for {rid}"

        # Logits at every sampled position (end of the chunked prefill, then each decode step).
        # After a preemption the request is recomputed, so a position may have been sampled twice:
        # the last sample of each position counts (it produced the kept token).
        rows = logits_seen[rid]
        got = torch.stack(rows[-n:])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
