"""Property tests: random interleavings of everything that can happen to a scheduler.

Each example builds a small scheduler (often with a pool so tiny that requests preempt each other)
and runs a random sequence of add / remote add / step (fake sampled tokens, sometimes eos) / abort /
finish / release / land / fail, checking the step's output against the requests and
`check_invariants()` (every block free xor owned, refcounts equal to the block tables holding them)
after every operation. It then either drains everything to completion — which must terminate —
or aborts everything; either way no block may stay referenced.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request, RequestStatus
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import ROLES, Scheduler, SchedulerOutput

EOS = 2
VOCAB = 8                 # prompt tokens: tiny, so prompts share prefixes
SAMPLED_VOCAB = 24        # sampled tokens: eos (and stop token 6) now and then
MAX_MODEL_LEN = 40
MAX_DRAIN_STEPS = 20_000

OPS = {
    "colocated": ["add", "add", "step", "step", "step", "abort", "finish"],
    "prefill": ["add", "add", "step", "step", "step", "abort", "finish", "release"],
    "decode": ["add", "add_remote", "add_remote", "step", "step", "step", "abort", "finish", "land", "land",
               "fail"],
}


@st.composite
def schedulers(draw, role: str, windows=st.none(), group_windows=st.just(()), block_sizes=(1, 2, 4, 8)) -> Scheduler:
    """A small scheduler; `windows` draws the model's sliding window (None: full attention),
    `group_windows` its KV groups' windows (engine/kv_groups/; (): one group)."""
    block_size = draw(st.sampled_from(block_sizes))
    groups = draw(group_windows)
    # Room for 16..48 tokens (of every group): one request fits, a few at once often do not (preemption).
    num_blocks = draw(st.integers(16, 48)) // block_size * max(1, len(groups)) + 1
    chunked = draw(st.sampled_from([True, True, True, False]))
    budget = draw(st.integers(1, 48)) if chunked else draw(st.integers(MAX_MODEL_LEN, 64))
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=draw(st.integers(1, 6)),
                             max_model_len=MAX_MODEL_LEN, policy=draw(st.sampled_from(["fcfs", "priority"])),
                             enable_chunked_prefill=chunked)
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=draw(st.booleans()),
                        sliding_window=draw(windows), kv_group_windows=groups)
    return Scheduler(config, cache, role=role, eos_token_ids=(EOS,))


def fits(scheduler: Scheduler, request: Request) -> bool:
    """Whether `add_request` must accept it (the scheduler validates exactly this)."""
    max_len = request.num_prompt_tokens + request.sampling_params.max_tokens
    kv, prompt = scheduler.kv_manager, request.num_prompt_tokens
    # A window caps what a request holds: a prefill pod's prompt, a decoding request's whole length.
    num_blocks = kv.max_blocks_held(prompt if scheduler.role == "prefill" else max_len,
                                    scheduler.config.max_num_batched_tokens)
    return max_len <= MAX_MODEL_LEN and num_blocks <= kv.block_pool.num_usable_blocks


def draw_request(data, rid: str, arrival: float) -> Request:
    prefix = data.draw(st.sampled_from([[], [3, 4, 5, 6, 7, 3, 4, 5], [5] * 12]))
    tail = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10))
    max_tokens = data.draw(st.integers(1, 20))
    params = SamplingParams(max_tokens=max_tokens, min_tokens=data.draw(st.integers(0, min(2, max_tokens))),
                            stop_token_ids=data.draw(st.sampled_from([(), (6,)])),
                            ignore_eos=data.draw(st.booleans()))
    return Request(rid, prefix + tail, params, arrival_time=arrival, priority=data.draw(st.integers(0, 2)))


def check_output(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """The step's batch must describe exactly what the requests need computed."""
    config, block_size = scheduler.config, scheduler.block_size
    ids = [seq.request_id for seq in out.scheduled]
    assert len(ids) == len(set(ids)) <= config.max_num_seqs
    assert out.num_batched_tokens == sum(len(seq.token_ids) for seq in out.scheduled) <= config.max_num_batched_tokens
    for seq in out.scheduled:
        request = scheduler.get_request(seq.request_id)
        assert request is not None and request.status is RequestStatus.RUNNING
        end = seq.start_position + len(seq.token_ids)
        assert len(seq.token_ids) >= 1 and seq.start_position == request.num_computed_tokens
        assert seq.token_ids == tuple(request.token_ids[seq.start_position:end])
        assert seq.block_ids == tuple(request.block_ids) and len(seq.block_ids) * block_size >= end
        assert seq.sample == (end == request.num_tokens)
    for rid in out.preempted_request_ids:
        assert rid not in ids
    for rid in out.reserved_request_ids:
        request = scheduler.get_request(rid)
        assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
        assert len(request.block_ids) == scheduler.kv_manager.num_blocks_for(request.num_prompt_tokens)


def do_step(scheduler: Scheduler, data, abort_midway: bool = False) -> None:
    out = scheduler.schedule()
    check_output(scheduler, out)
    if out.preempted_request_ids:
        event("preempted")      # `pytest --hypothesis-show-statistics` shows how often paths are hit
    if out.reserved_request_ids:
        event("reserved")
    if any(seq.start_position and len(seq.token_ids) > 1 for seq in out.scheduled):
        event("chunk continued or prefix hit")
    sampled = {seq.request_id: data.draw(st.integers(0, SAMPLED_VOCAB - 1)) for seq in out.scheduled if seq.sample}
    if abort_midway and out.scheduled:   # the engine may abort between schedule and update
        scheduler.abort_request(data.draw(st.sampled_from(out.scheduled)).request_id)
    before = {rid: scheduler.get_request(rid).num_output_tokens for rid in sampled if scheduler.get_request(rid)}
    updated = scheduler.update(out, sampled)
    assert {r.request_id for r in updated} == set(before)
    for request in updated:
        assert request.num_output_tokens == before[request.request_id] + 1
        assert request.output_token_ids[-1] == sampled[request.request_id]
        assert request.num_output_tokens <= request.sampling_params.max_tokens
    scheduler.check_invariants()


def pick(data, ids) -> str | None:
    ids = sorted(ids)
    return data.draw(st.sampled_from(ids)) if ids else None


@pytest.mark.parametrize("role", ROLES)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_operations_never_leak_or_double_own_a_block(role, data):
    scheduler = data.draw(schedulers(role))
    requests: list[Request] = []
    num_ops = data.draw(st.integers(5, 60))
    for i in range(num_ops):
        op = data.draw(st.sampled_from(OPS[role]))
        if op in ("add", "add_remote"):
            request = draw_request(data, f"r{i}", arrival=float(i))
            add = scheduler.add_request if op == "add" else scheduler.add_remote_request
            if fits(scheduler, request):
                add(request)
                requests.append(request)
            else:
                with pytest.raises(ValueError):
                    add(request)
        elif op == "step":
            do_step(scheduler, data, abort_midway=data.draw(st.integers(0, 9)) == 0)
        elif op == "abort":
            rid = pick(data, scheduler.requests) or "missing"
            assert scheduler.abort_request(rid) == (rid != "missing")
            assert not scheduler.abort_request(rid)
        elif op == "finish":
            rid = pick(data, scheduler.requests)
            if rid is not None:
                assert scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        elif op == "release":
            rid = pick(data, scheduler.held)
            if rid is not None:
                assert scheduler.release_request(rid) and not scheduler.release_request(rid)
        elif op == "land":
            rid = pick(data, scheduler.waiting_for_remote_kv)
            if rid is not None:
                finished = scheduler.remote_kv_landed(rid, data.draw(st.integers(0, SAMPLED_VOCAB - 1)))
                assert finished == (scheduler.get_request(rid) is None)
        elif op == "fail":
            remote = list(scheduler.waiting_for_remote_kv) + [r.request_id for r in scheduler.waiting_for_blocks]
            rid = pick(data, remote)
            if rid is not None:
                assert scheduler.remote_kv_failed(rid)
        scheduler.check_invariants()

    if scheduler.kv_manager.num_hit_tokens:
        event("prefix cache hit")
    if data.draw(st.booleans()):
        drain(scheduler, data)
    else:
        for rid in list(scheduler.requests):
            assert scheduler.abort_request(rid)
    scheduler.check_invariants()
    assert not scheduler.requests and not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_usage == 0.0
    assert scheduler.num_free_blocks == scheduler.kv_manager.block_pool.num_usable_blocks
    assert all(r.is_finished and not r.block_ids for r in requests)


def drain(scheduler: Scheduler, data) -> None:
    """Run everything to completion (KV lands, held KV is pulled); must terminate: no livelock."""
    for _ in range(MAX_DRAIN_STEPS):
        for rid in list(scheduler.waiting_for_remote_kv):
            scheduler.remote_kv_landed(rid, 5)
        for rid in list(scheduler.held):
            scheduler.release_request(rid)
        if not scheduler.has_unfinished_requests():
            return
        do_step(scheduler, data)
    raise AssertionError(f"no progress after {MAX_DRAIN_STEPS} steps")
