"""Async scheduling (step N+1 planned while step N runs) gives exactly the synchronous results.

Every test runs the same requests through a synchronous and an asynchronous engine on the tiny
preset and compares tokens, texts and finish reasons: stop tokens and eos found one step late,
length stops, stop strings, preemption, penalties (which resolve before sampling), aborts at
every point, and the decode role's KV landing. On CPU the overlap saves nothing; the ordering
logic is what is tested here.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from engine.config import CacheConfig, SchedulerConfig
import engine.engine as engine_module
import engine.scheduling.scheduler as scheduler_module
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from engine.step_outputs import StepOutputs, split
from tests.engine.pd_handoff import run_disaggregated


def make_engine(async_scheduling: bool, role: str = "colocated", num_blocks: int = 256, **sched) -> Engine:
    return Engine(EngineConfig(model="tiny", role=role, async_scheduling=async_scheduling,
                               cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                               scheduler=SchedulerConfig(**{"max_num_batched_tokens": 64, **sched})))


@pytest.fixture(scope="module", autouse=True)
def columns_at_every_batch():
    """The async engine plans steady decode steps as columns (`engine.decode_columns`) at these
    tests' small batches too: every test here checks that path against the synchronous engine."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(scheduler_module, "COLUMNS_MIN_BATCH", 1)
        yield


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    return make_engine(False), make_engine(True)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(n - 1)]


def _summary(outputs):
    return [(o.output_token_ids, o.text, o.finish_reason, o.stop_reason) for o in outputs]


def _same(engines, prompts, params):
    sync, async_ = engines
    want = sync.generate(prompts, params)
    got = async_.generate(prompts, params)
    assert _summary(got) == _summary(want)
    assert async_.stats().kv_cache_usage == 0.0 and not async_.has_unfinished_requests()
    return want


def test_async_engine_is_on_only_where_asked(engines):
    sync, async_ = engines          # make_engine(False), make_engine(True)
    assert async_.async_scheduling and not sync.async_scheduling
    assert not Engine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=16))).async_scheduling  # CPU
    assert not make_engine(True, role="prefill").async_scheduling


def test_greedy_and_seeded_outputs_equal_the_synchronous_engine(engines):
    prompts = [_prompt(s, 10 + 17 * s) for s in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=5 + 3 * s) for s in range(3)] + \
             [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=s, max_tokens=9 + s) for s in range(3)]
    _same(engines, prompts, params)


def test_stop_tokens_found_a_step_late_end_the_request_at_the_same_token(engines):
    """The stop token is known only when the next step is already planned: the request must end
    with it (finish reason "stop", stop_reason the token), its extra row dropped."""
    prompt = _prompt(21, 30)
    free = engines[0].generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    stop_token = free.output_token_ids[6]
    params = [SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_token]),
              SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_token], min_tokens=8),
              # the stop token at the very last position: "stop", not "length"
              SamplingParams(temperature=0.0, max_tokens=free.output_token_ids.index(stop_token) + 1,
                             stop_token_ids=[stop_token])]
    want = _same(engines, [prompt] * 3, params)
    assert want[0].finish_reason == "stop" and want[0].stop_reason == stop_token
    assert want[2].finish_reason == "stop"


def test_stop_strings_equal_the_synchronous_engine(engines):
    (free,) = engines[0].generate(["abc"], SamplingParams(temperature=0.0, max_tokens=30))
    if len(free.text) < 4:
        pytest.skip("the tiny model's text is too short for a stop string")
    want = _same(engines, ["abc", "abd"], SamplingParams(temperature=0.0, max_tokens=30, stop=[free.text[2:4]]))
    assert want[0].finish_reason == "stop"


def test_penalties_read_the_previous_token_and_equal_the_synchronous_engine(engines):
    prompts = [_prompt(s, 12) for s in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=0.8, presence_penalty=0.4),
              SamplingParams(temperature=0.0, max_tokens=12)]
    _same(engines, prompts, params)


def test_preemption_under_a_small_cache_equals_the_synchronous_engine():
    prompts = [_prompt(s, 40 + 9 * s) for s in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    sync, async_ = make_engine(False, num_blocks=14), make_engine(True, num_blocks=14)
    want = sync.generate(prompts, params)
    got = async_.generate(prompts, params)
    assert async_.stats().num_preemptions > 0
    assert _summary(got) == _summary(want)
    assert async_.stats().num_free_blocks == async_.scheduler.kv_manager.block_pool.num_usable_blocks


@pytest.mark.parametrize("steps_before_abort", [0, 1, 2, 3, 6])
def test_abort_at_any_step_frees_everything_and_leaves_the_others_exact(engines, steps_before_abort):
    sync, async_ = engines
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    keep = _prompt(31, 20)
    (want,) = sync.generate([keep], params)
    async_.add_request(_prompt(32, 70), params, request_id="victim")
    async_.add_request(keep, params, request_id="keep")
    outputs = []
    for _ in range(steps_before_abort):
        outputs += async_.step()
    assert async_.abort("victim")
    while async_.has_unfinished_requests():
        outputs += async_.step()
    assert not [o for o in outputs if o.request_id == "victim" and o.finished]
    kept = [o for o in outputs if o.request_id == "keep"]
    assert [t for o in kept for t in o.new_token_ids] == want.output_token_ids
    assert kept[-1].finished and kept[-1].finish_reason == "length"
    assert async_.stats().kv_cache_usage == 0.0


def test_abort_of_the_only_request_leaves_nothing_in_flight(engines):
    async_ = engines[1]
    async_.add_request(_prompt(33, 10), SamplingParams(max_tokens=20, ignore_eos=True), request_id="only")
    for _ in range(3):
        async_.step()
    assert async_.has_unfinished_requests()
    assert async_.abort("only")
    assert not async_.has_unfinished_requests() and async_.stats().kv_cache_usage == 0.0


def test_decode_role_landing_remote_kv_equals_colocated():
    """A decode engine with async scheduling: prompts arrive with KV written into reserved blocks
    (as the transfer layer does) and their first token; output equals the colocated engine."""
    prompts = [_prompt(41 + s, 25 + 11 * s) for s in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    want = make_engine(False).generate(prompts, params)
    prefill, decode = make_engine(False, role="prefill"), make_engine(True, role="decode")
    assert run_disaggregated(prefill, decode, prompts, params) == [w.output_token_ids for w in want]
    assert decode.stats().kv_cache_usage == 0.0


def _view(out):
    """An output's fields as of now (the run's clock aside: times only as set or not)."""
    fields = dataclasses.asdict(out)
    for name in ("first_token_time", "arrival_time", "first_scheduled_time"):
        fields[name] = fields[name] is not None
    fields.pop("num_cached_tokens")
    return fields


def _streams(engine, prompts, params, ids) -> tuple[dict[str, list], list]:
    for prompt, p, rid in zip(prompts, params, ids):
        engine.add_request(prompt, p, request_id=rid)
    streams, steps = {rid: [] for rid in ids}, []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps.append(outputs)
        for out in outputs:
            streams[out.request_id].append(_view(out))
    return streams, steps


def test_a_steps_batched_outputs_read_as_the_per_request_outputs(engines, monkeypatch):
    """`StepOutputs` (token rows as columns) reads exactly as the per-request outputs the engine
    builds when every row is its own `RequestOutput`, whatever the row needs (logprobs, prompt
    logprobs, a stop string or token, a length stop), and `split` (the decode pod's packing)
    partitions it into the same rows."""
    async_ = engines[1]
    # As in the pods: text only where a stop string needs it (other rows are token rows).
    monkeypatch.setattr(async_, "config", dataclasses.replace(async_.config, detokenize=False))
    prompts = [_prompt(50 + s, 8 + s) for s in range(5)]   # under a block: no prefix-cache hits, same floats
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=6, stop=["\x7f\x7f\x7f"]),
              SamplingParams(temperature=0.9, seed=3, max_tokens=3, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=5)]
    ids = [f"rows-{s}" for s in range(5)]
    with monkeypatch.context() as m:     # every row its own RequestOutput: the per-request view
        m.setattr(engine_module, "other_rows", lambda requests, *_: list(range(len(requests))))
        want, _ = _streams(async_, prompts, params, ids)
    got, steps = _streams(async_, prompts, params, ids)
    assert got == want and all(stream[-1]["finished"] for stream in got.values())
    batched = [s for s in steps if isinstance(s, StepOutputs)]
    assert any(len(s.others) < len(s) for s in batched) and any(s.others for s in batched)
    for outputs in batched:
        token_ids, tokens, others = split(outputs, own=lambda rid: rid == "rows-0")
        views = [_view(o) for o in outputs]
        assert [_view(outputs[i]) for i in range(len(outputs))] == views
        assert sorted(token_ids + [o.request_id for o in others]) == sorted(v["request_id"] for v in views)
        # The other rows are the step's own outputs, in batch order (a finished row marked `own`
        # keeps its output: a colocated pod's one-token scoring request finishes on its first).
        assert [_view(o) for o in others] == [v for v in views if v["request_id"] not in token_ids]
        assert "rows-0" not in token_ids and all(not o.finished for o in map(outputs.__getitem__, [
            i for i, r in enumerate(outputs.requests) if r.request_id in token_ids]))
        assert [outputs.token_ids[i] for i, r in enumerate(outputs.requests) if r.request_id in token_ids] == tokens
