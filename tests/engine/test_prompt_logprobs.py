"""Prompt logprobs equal transformers' log-softmax over the prompt (fp32, 1e-4): across chunk
boundaries, with a cached prefix, through preemption, synchronous and async scheduling; and the
requests that do not ask are untouched (same logits path, prefix cache as before)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams, SamplingParamsError
from tests.engine.hf_models import make_hf_model

TOP = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_gqa")
    return path, make_hf_model("llama_gqa", path)


def _reference(hf, prompt: list[int]):
    """(logprob of token i+1, its rank, top-k ids, top-k logprobs) per position i, from one forward."""
    with torch.no_grad():
        logprobs = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)[:-1]     # [n-1, vocab]
    targets = torch.tensor(prompt[1:])
    token_lp = logprobs.gather(1, targets[:, None])[:, 0]
    ranks = (logprobs > token_lp[:, None]).sum(1) + 1
    top_lp, top_ids = logprobs.topk(TOP, dim=-1)
    return token_lp, ranks, top_ids, top_lp


def _check(out, hf, prompt: list[int], num_top: int = TOP) -> None:
    scores = out.prompt_logprobs
    assert scores is not None and scores.num_top == num_top
    assert scores.num_scored == len(prompt) - 1
    token_lp, ranks, top_ids, top_lp = _reference(hf, prompt)
    torch.testing.assert_close(torch.tensor(scores.token_logprobs), token_lp, atol=1e-4, rtol=0)
    assert scores.token_ranks == ranks.tolist()
    if num_top:
        got_ids = torch.tensor(scores.top_token_ids).view(-1, num_top)
        got_lp = torch.tensor(scores.top_logprobs).view(-1, num_top)
        torch.testing.assert_close(got_lp, top_lp[:, :num_top], atol=1e-4, rtol=0)
        # Ids may differ only where two logprobs tie within the tolerance.
        same = got_ids == top_ids[:, :num_top]
        assert bool(same.all()) or bool(((got_lp - top_lp[:, :num_top]).abs() < 1e-4)[~same].all())


def _engine(path, budget: int = 16, num_blocks: int | None = None, async_scheduling: bool | None = None,
            max_num_seqs: int = 4) -> Engine:
    return Engine(EngineConfig(model=str(path), cache=CacheConfig(block_size=8, num_blocks=num_blocks),
                               scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
                               async_scheduling=async_scheduling))


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _first_outputs(engine: Engine, requests) -> dict[str, object]:
    """Run to completion; each request's first output (the one that carries prompt logprobs)."""
    first = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, out)
            if out.request_id in first and first[out.request_id] is not out:
                assert out.prompt_logprobs is None, "prompt logprobs come once, on the first output"
    return first


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prompts_are_scored_exactly(checkpoint, async_scheduling):
    path, hf = checkpoint
    engine = _engine(path, budget=16, async_scheduling=async_scheduling)   # chunks of <= 16 tokens
    prompts = _prompts(hf.config.vocab_size, [37, 5, 2, 50, 16])
    greedy = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP)
    reqs = [engine.add_request(p, greedy) for p in prompts]
    plain = engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=3))
    first = _first_outputs(engine, reqs + [plain])
    for req, prompt in zip(reqs, prompts):
        _check(first[req.request_id], hf, prompt)
    assert first[plain.request_id].prompt_logprobs is None
    assert not engine.prompt_logprobs.pending and not engine.prompt_logprobs.has_done


def test_a_cached_prefix_is_scored_too_and_others_still_hit_the_cache(checkpoint):
    path, hf = checkpoint
    engine = _engine(path, budget=64)
    (shared,) = _prompts(hf.config.vocab_size, [40], seed=1)
    engine.generate([shared], SamplingParams(temperature=0.0, max_tokens=1))    # caches 5 blocks
    asking = engine.add_request(shared + [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))
    first = _first_outputs(engine, [asking])
    out = first[asking.request_id]
    assert out.num_cached_tokens == 0, "a request that asks runs its whole prompt"
    _check(out, hf, shared + [7, 8, 9], num_top=0)
    (again,) = engine.generate([shared + [7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=1))
    assert again.num_cached_tokens == 40, "requests that do not ask use the cache as before"


def test_preemption_recomputes_without_scoring_twice(checkpoint):
    path, hf = checkpoint
    # 11 usable blocks of 8 tokens: three 30-token prompts growing by 20 tokens cannot all fit.
    engine = _engine(path, budget=16, num_blocks=12, max_num_seqs=3)
    prompts = _prompts(hf.config.vocab_size, [30, 30, 30], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=2)
    reqs = [engine.add_request(p, params) for p in prompts]
    first = _first_outputs(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    for req, prompt in zip(reqs, prompts):
        _check(first[req.request_id], hf, prompt, num_top=2)
    engine.scheduler.kv_manager.block_pool.check_invariants()


def test_prefill_role_scores_with_its_first_token(checkpoint):
    path, hf = checkpoint
    engine = Engine(EngineConfig(model=str(path), role="prefill", cache=CacheConfig(block_size=8),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=16)))
    (prompt,) = _prompts(hf.config.vocab_size, [29], seed=3)
    req = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=TOP))
    outputs = []
    while not outputs:
        outputs = engine.step()
    (out,) = outputs
    assert out.finish_reason == "prefilled"
    _check(out, hf, prompt)
    engine.abort(req.request_id)


def test_abort_forgets_pending_scores(checkpoint):
    path, hf = checkpoint
    engine = _engine(path, budget=8)
    (prompt,) = _prompts(hf.config.vocab_size, [30], seed=4)
    req = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))
    engine.step()                       # one 8-token chunk scored
    assert engine.prompt_logprobs.pending
    engine.abort(req.request_id)
    assert not engine.prompt_logprobs.pending and not engine.prompt_logprobs.has_done
    assert engine.stats().kv_cache_usage == 0.0


def test_prompt_logprobs_range_is_checked():
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(prompt_logprobs=21)
    assert e.value.param == "prompt_logprobs"


def test_decode_role_passes_scores_through_or_computes_them_on_fallback(checkpoint):
    path, hf = checkpoint
    prompt = _prompts(hf.config.vocab_size, [21], seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1)
    prefill = Engine(EngineConfig(model=str(path), role="prefill", cache=CacheConfig(block_size=8)))
    prefill.add_request(prompt, params, "r")
    (scored,) = [o for _ in range(4) for o in prefill.step()]
    decode = Engine(EngineConfig(model=str(path), role="decode", cache=CacheConfig(block_size=8)))
    decode.add_request(prompt, params, "r", remote_kv=True)
    decode.add_request(prompt, params, "fallback", remote_kv=True)
    assert not decode.prompt_logprobs.pending, "a remote-KV request's prompt runs elsewhere"
    decode.step()                                   # reserves both
    out = decode.land_remote_kv("r", scored.new_token_ids[0], None, prompt_logprobs=scored.prompt_logprobs)
    assert out.prompt_logprobs is scored.prompt_logprobs
    assert decode.fall_back_to_local_prefill("fallback")
    first = _first_outputs(decode, [])
    _check(first["fallback"], hf, prompt, num_top=1)
    assert first["r"].prompt_logprobs is None      # already sent with the landed first token


def test_tensor_parallel_scores_equal_transformers(checkpoint, monkeypatch):
    """TP=2 (Gloo, one rank subprocess): the extra rows go through the vocab-parallel head in slices
    of max_num_seqs=2 rows, and rank 1 makes the same collective calls without knowing which rows
    are extra."""
    monkeypatch.setenv("CBSERVE_NUM_THREADS", "1")
    path, hf = checkpoint
    engine = Engine(EngineConfig(model=str(path), tensor_parallel_size=2, cache=CacheConfig(block_size=8),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2)))
    try:
        prompts = _prompts(hf.config.vocab_size, [23, 9], seed=6)
        params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP)
        reqs = [engine.add_request(p, params) for p in prompts]
        first = _first_outputs(engine, reqs)
        for req, prompt in zip(reqs, prompts):
            _check(first[req.request_id], hf, prompt)
    finally:
        engine.close()


def test_runner_skips_decode_buckets_and_slices_the_extra_rows(checkpoint):
    """A one-token chunk that needs its logits looks like a decode step: it must run eagerly. Extra
    rows beyond the first slice (max_num_seqs rows) arrive in later slices, in order."""
    from engine.kv_cache import allocate_kv_cache
    from engine.loader import load_model
    from engine.model_config import ModelConfig
    from engine.model_runner import ModelRunner
    from engine.prompt_logprobs import StepRows
    from engine.scheduling.output import ScheduledSeq

    path, hf = checkpoint
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), 128)
    kv = allocate_kv_cache(cfg, 16, 8, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, kv, 8, torch.device("cpu"), max_num_seqs=2, max_num_batched_tokens=32,
                         max_model_len=64, enforce_eager=False)       # padded decode buckets, on CPU
    assert runner.decode_buckets is not None
    (prompt,) = _prompts(hf.config.vocab_size, [12], seed=8)
    prefill = [ScheduledSeq("a", tuple(prompt[:11]), 0, (1, 2), False)]
    seen: list[tuple[int, torch.Tensor]] = []

    class Rows(StepRows):
        def consume(self, first_row, logits):
            seen.append((first_row, logits.clone()))

    extra = Rows(np.arange(11, dtype=np.int64), np.array(prompt[1:12]), [], 0)
    assert runner.run(prefill, extra=extra).shape[0] == 0          # nothing samples in this chunk
    assert [first for first, _ in seen] == [0, 2, 4, 6, 8, 10]      # slices of max_num_seqs=2 rows
    got = torch.cat([logits for _, logits in seen])
    with torch.no_grad():
        want = hf(torch.tensor([prompt[:11]])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    seen.clear()
    last = [ScheduledSeq("a", (prompt[11],), 11, (1, 2), True)]     # shaped like a decode step
    extra = Rows(np.zeros(1, dtype=np.int64), np.array([prompt[0]]), [], 0)
    sampled = runner.run(last, extra=extra)
    with torch.no_grad():
        full = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(sampled[0], full[11], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(seen[0][1][0], full[11], atol=1e-4, rtol=1e-4)
