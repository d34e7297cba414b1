"""Engine-level behaviour on the built-in tiny preset: prefix caching, seeded determinism, the API."""

from __future__ import annotations

import random

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig, EngineRequestError
from engine.sampling.params import SamplingParams


def make_engine(**sched) -> Engine:
    return Engine(EngineConfig(model="tiny", cache=CacheConfig(block_size=16, num_blocks=256),
                               scheduler=SchedulerConfig(**{"max_num_batched_tokens": 64, **sched})))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(n - 1)]


def test_prefix_cache_hit_gives_the_same_tokens_and_is_counted(engine):
    shared = _prompt(1, 80)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    (miss,) = engine.generate([shared + [10, 11, 12]], greedy)
    hits_before = engine.scheduler.kv_manager.num_hit_tokens
    (hit,) = engine.generate([shared + [10, 11, 12]], greedy)
    assert hit.output_token_ids == miss.output_token_ids
    assert hit.num_cached_tokens >= 80 // 16 * 16  # every full block of the shared prefix
    assert engine.scheduler.kv_manager.num_hit_tokens - hits_before == hit.num_cached_tokens
    assert engine.stats().prefix_cache_hit_ratio > 0
    assert engine.stats().kv_cache_usage == 0.0


def test_seeded_sampling_is_the_same_alone_batched_and_chunked():
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24)
    target = _prompt(7, 70)
    alone = make_engine(max_num_batched_tokens=512).generate([target], params)[0].output_token_ids
    # chunked (budget 16 < prompt) and batched with others that use other seeds and settings
    others = [_prompt(s, 20 + 13 * s) for s in range(5)]
    other_params = [SamplingParams(temperature=1.0, seed=s, max_tokens=10 + s) for s in range(5)]
    outs = make_engine(max_num_batched_tokens=16).generate(
        others[:2] + [target] + others[2:], other_params[:2] + [params] + other_params[2:])
    assert outs[2].output_token_ids == alone
    # a different seed gives different tokens (the seed is actually used)
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=24)
    assert make_engine().generate([target], other_seed)[0].output_token_ids != alone


def test_stop_strings_and_max_tokens(engine):
    (free,) = engine.generate(["abc"], SamplingParams(temperature=0.0, max_tokens=30))
    assert free.finish_reason in ("length", "stop")
    text = free.text
    if len(text) >= 4:
        stop = text[2:4]
        (stopped,) = engine.generate(["abc"], SamplingParams(temperature=0.0, max_tokens=30, stop=[stop]))
        assert stopped.finish_reason == "stop"
        assert stop not in stopped.text
        assert text.startswith(stopped.text)


def test_abort_frees_blocks_at_every_stage(engine):
    free0 = engine.stats().num_free_blocks
    engine.add_request(_prompt(3, 200), SamplingParams(max_tokens=50), request_id="a")
    assert engine.abort("a")                       # before any step
    engine.add_request(_prompt(4, 200), SamplingParams(max_tokens=50), request_id="b")
    engine.step()                                  # mid chunked prefill
    assert engine.abort("b")
    # ignore_eos: sampled at temperature 1 from the global generator, "c" could otherwise end before
    # its abort, depending on which tests ran before in the process
    engine.add_request(_prompt(5, 20), SamplingParams(max_tokens=50, ignore_eos=True), request_id="c")
    for _ in range(5):
        engine.step()                              # decoding
    assert engine.abort("c")
    assert not engine.abort("c")                   # idempotent
    assert engine.stats().num_free_blocks == free0
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "empty"),
    ([1, 999999], SamplingParams(), "token ids"),
    ([1, 2, 3], SamplingParams(max_tokens=5000), "maximum context length"),
])
def test_bad_requests_are_refused_clearly(engine, prompt, params, message):
    with pytest.raises(EngineRequestError, match=message):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_engines_run_and_mostly_agree_with_fp32(dtype):
    prompt = _prompt(11, 40)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    fp32 = make_engine().generate([prompt], params)[0].output_token_ids
    half = Engine(EngineConfig(model="tiny", dtype=dtype, cache=CacheConfig(num_blocks=64)))
    assert half.kv_cache.dtype == getattr(__import__("torch"), dtype)
    tokens = half.generate([prompt], params)[0].output_token_ids
    assert len(tokens) == 8
    assert tokens[0] == fp32[0]  # rounding may change later tokens, not the first on a peaked model


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_detokenize_off_keeps_text_only_for_stop_strings(engine, async_scheduling):
    """Pods run with `detokenize=False`: no tokenizer work for a request without stop strings, and
    one with stop strings ends exactly where the detokenizing engine ends it."""
    (free,) = engine.generate(["abc"], SamplingParams(temperature=0.0, max_tokens=30))
    if len(free.text) < 4:
        pytest.skip("the tiny model's text is too short for a stop string")
    stop = SamplingParams(temperature=0.0, max_tokens=30, stop=[free.text[2:4]])
    (want,) = engine.generate(["abc"], stop)
    lean = Engine(EngineConfig(model="tiny", detokenize=False, async_scheduling=async_scheduling,
                               cache=CacheConfig(block_size=16, num_blocks=256),
                               scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    lean.add_request("abc", SamplingParams(temperature=0.0, max_tokens=30), request_id="plain")
    lean.add_request("abc", stop, request_id="stops")
    assert set(lean._detok) == {"stops"}            # the plain request has no detokenizer
    final = {}
    while lean.has_unfinished_requests():
        final.update((o.request_id, o) for o in lean.step() if o.finished)
    assert final["plain"].output_token_ids == free.output_token_ids and final["plain"].text == ""
    got = final["stops"]
    assert (got.output_token_ids, got.text, got.finish_reason, got.stop_reason) == \
        (want.output_token_ids, want.text, want.finish_reason, want.stop_reason)
    assert not lean._detok
