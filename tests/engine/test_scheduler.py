"""Scheduler unit tests with hand-made requests: no model, no torch."""

from __future__ import annotations

import itertools

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request, RequestStatus
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler, SchedulerOutput

EOS = 2
_bases = itertools.count(1000, 1000)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 16, max_seqs: int = 8,
                   max_model_len: int = 64, policy: str = "fcfs", role: str = "colocated",
                   caching: bool = True, chunked: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, max_seqs, max_model_len, policy, chunked),
                     CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching),
                     role=role, eos_token_ids=(EOS,))


def make_request(rid: str, num_prompt: int = 10, max_tokens: int = 8, arrival: float = 0.0,
                 priority: int = 0, tokens: list[int] | None = None, **params) -> Request:
    """A request with a prompt of distinct tokens (no accidental prefix hits unless `tokens` says so)."""
    if tokens is None:
        base = next(_bases)
        tokens = list(range(base, base + num_prompt))
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **params),
                   arrival_time=arrival, priority=priority)


def step(scheduler: Scheduler, token: int = 7, tokens: dict[str, int] | None = None
         ) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with a fake sampler: every sampling seq gets `token` (or `tokens[id]`)."""
    out = scheduler.schedule()
    sampled = {s.request_id: (tokens or {}).get(s.request_id, token) for s in out.scheduled if s.sample}
    updated = scheduler.update(out, sampled)
    scheduler.check_invariants()
    return out, updated


def shape(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.request_id, s.start_position, len(s.token_ids), s.sample) for s in out.scheduled]


# ---------------------------------------------------------------------- budget and order
def test_token_budget_is_split_and_prefills_continue_in_chunks():
    s = make_scheduler(budget=16)
    a, b, c = make_request("a"), make_request("b"), make_request("c")
    for r in (a, b, c):
        s.add_request(r)
    out, updated = step(s)
    assert shape(out) == [("a", 0, 10, True), ("b", 0, 6, False)]
    assert out.num_batched_tokens == 16 and updated == [a]
    assert s.last_progressed == [a, b]
    assert out.scheduled[1].token_ids == tuple(b.prompt_token_ids[:6])
    # Decode of a first, b finishes its prompt, c takes what is left.
    out, updated = step(s)
    assert shape(out) == [("a", 10, 1, True), ("b", 6, 4, True), ("c", 0, 10, True)]
    assert out.num_batched_tokens == 15 and updated == [a, b, c]
    assert out.scheduled[1].token_ids == tuple(b.prompt_token_ids[6:])
    assert out.scheduled[0].token_ids == (7,)            # a's sampled token is fed back
    assert all(len(seq.block_ids) * 4 >= seq.start_position + len(seq.token_ids) for seq in out.scheduled)


def test_decodes_are_scheduled_before_an_earlier_partial_prefill():
    s = make_scheduler(budget=16, role="decode")
    long = make_request("long", num_prompt=40)
    s.add_request(long)
    step(s)                                              # long: 16 of 40 tokens
    remote = make_request("remote", num_prompt=5)
    s.add_remote_request(remote)
    out = s.schedule()
    assert out.reserved_request_ids == ("remote",)
    s.update(out, {})
    assert not s.remote_kv_landed("remote", 9)
    assert [r.request_id for r in s.running] == ["long", "remote"]
    out, _ = step(s)
    assert shape(out) == [("remote", 5, 1, True), ("long", 32, 8, True)]


def test_fcfs_admits_in_arrival_order_and_priority_by_priority_then_arrival():
    for policy, expected in (("fcfs", "low"), ("priority", "high")):
        s = make_scheduler(budget=10, policy=policy)
        s.add_request(make_request("low", arrival=0.0, priority=5))
        s.add_request(make_request("high", arrival=1.0, priority=0))
        s.add_request(make_request("high-later", arrival=2.0, priority=0))
        out, _ = step(s)
        assert [seq.request_id for seq in out.scheduled] == [expected]
    assert [r.request_id for r in s.waiting] == ["high-later", "low"]


def test_max_num_seqs_caps_the_batch():
    s = make_scheduler(budget=64, max_seqs=2)
    for rid in "abc":
        s.add_request(make_request(rid, num_prompt=3, max_tokens=1))
    out, _ = step(s)
    assert [seq.request_id for seq in out.scheduled] == ["a", "b"]
    assert s.num_running == 0 and s.num_waiting == 1    # both finished (max_tokens=1)
    out, _ = step(s)
    assert [seq.request_id for seq in out.scheduled] == ["c"]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_holds_it():
    s = make_scheduler(budget=64, max_model_len=64, chunked=False)
    s.add_request(make_request("a", num_prompt=40))
    s.add_request(make_request("b", num_prompt=30))
    out, _ = step(s)
    assert shape(out) == [("a", 0, 40, True)]
    out, _ = step(s)
    assert shape(out) == [("a", 40, 1, True), ("b", 0, 30, True)]


# ---------------------------------------------------------------------- preemption
def _two_growing_requests(policy: str, old_priority: int = 5) -> tuple[Scheduler, Request, Request]:
    """4 usable blocks of 4 tokens; `old` (admitted first) and `new` hold 2 blocks each, and both
    need a third block at the next decode."""
    s = make_scheduler(num_blocks=5, budget=16, policy=policy)
    old = make_request("old", num_prompt=7, priority=old_priority, arrival=0.0)
    new = make_request("new", num_prompt=7, priority=0, arrival=1.0)
    s.add_request(old)
    step(s)                                              # old: 7 prompt tokens
    s.add_request(new)
    step(s)                                              # old decodes at 7; new: 7 prompt tokens
    assert s.kv_manager.num_free_blocks == 0
    return s, old, new


def test_fcfs_preempts_the_newest_running_request_by_recompute():
    s, old, new = _two_growing_requests("fcfs")
    out, _ = step(s)            # old needs a block at position 8: new is the victim
    assert out.preempted_request_ids == ("new",)
    assert shape(out) == [("old", 8, 1, True)]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0 and new.block_ids == []
    assert s.num_preemptions == 1 and new.num_preemptions == 1
    assert list(s.waiting) == [new]
    # Once old is done, new recomputes prompt + its one output token, then samples its second.
    while new.status is not RequestStatus.RUNNING:
        out, _ = step(s)
    seq = next(q for q in out.scheduled if q.request_id == "new")
    assert seq.start_position + len(seq.token_ids) == 8 and seq.sample
    assert new.num_output_tokens == 2


def test_priority_preempts_the_lowest_priority_even_itself():
    s, old, new = _two_growing_requests("priority")
    out, _ = step(s)            # old (priority 5) needs the block but is the lowest: it yields
    assert out.preempted_request_ids == ("old",)
    assert shape(out) == [("new", 7, 1, True)]
    assert old.status is RequestStatus.PREEMPTED and new.status is RequestStatus.RUNNING


def test_priority_ties_preempt_the_newest():
    s, old, new = _two_growing_requests("priority", old_priority=0)
    out, _ = step(s)
    assert out.preempted_request_ids == ("new",) and shape(out) == [("old", 8, 1, True)]


def test_a_preempted_victim_that_was_already_scheduled_leaves_the_batch():
    s = make_scheduler(num_blocks=5, budget=16)
    a = make_request("a", num_prompt=7)
    b = make_request("b", num_prompt=8)
    s.add_request(a)
    s.add_request(b)
    step(s)                     # a: 7 tokens (2 blocks); b: 8 tokens (2 blocks, full)
    out, _ = step(s)            # a decodes at 7 (fits); b decodes at 8: needs a block, b is the victim
    assert out.preempted_request_ids == ("b",)
    assert shape(out) == [("a", 7, 1, True)] and out.num_batched_tokens == 1


# ---------------------------------------------------------------------- prefix cache
def test_prefix_hit_skips_cached_blocks_and_is_counted():
    s = make_scheduler(budget=32)
    shared = list(range(500, 512))
    first = make_request("first", tokens=shared + [1, 1], max_tokens=1)
    s.add_request(first)
    step(s)
    assert first.is_finished
    second = make_request("second", tokens=shared + [3])
    s.add_request(second)
    out, _ = step(s)
    assert shape(out) == [("second", 12, 1, True)]
    assert out.scheduled[0].token_ids == (3,)
    assert second.num_cached_tokens == 12
    assert s.kv_manager.num_hit_tokens == 12 and s.kv_manager.num_queried_tokens == 14 + 13
    assert s.prefix_cache_hit_ratio == pytest.approx(12 / 27)


# ---------------------------------------------------------------------- stops
@pytest.mark.parametrize("params, tokens, status, num_output, stop_reason", [
    (dict(max_tokens=8), [5, EOS], RequestStatus.FINISHED_STOPPED, 2, None),
    (dict(max_tokens=3, ignore_eos=True), [EOS, EOS, EOS], RequestStatus.FINISHED_LENGTH, 3, None),
    (dict(max_tokens=8, min_tokens=3), [EOS, EOS, EOS], RequestStatus.FINISHED_STOPPED, 3, None),
    (dict(max_tokens=8, stop_token_ids=(11,)), [5, 11], RequestStatus.FINISHED_STOPPED, 2, 11),
    (dict(max_tokens=2), [5, 6], RequestStatus.FINISHED_LENGTH, 2, None),
])
def test_token_level_stops(params, tokens, status, num_output, stop_reason):
    s = make_scheduler()
    request = Request("r", [100, 101, 102], SamplingParams(**params))
    s.add_request(request)
    for token in tokens:
        step(s, token=token)
    assert request.status is status and request.num_output_tokens == num_output
    assert request.stop_reason == stop_reason and request.finished_time is not None
    assert request.block_ids == [] and s.kv_cache_usage == 0.0 and not s.has_unfinished_requests()
    assert s.schedule().finished_request_ids == ("r",)


def test_max_model_len_ends_a_request():
    s = make_scheduler(max_model_len=8)
    request = Request("r", list(range(100, 105)), SamplingParams(max_tokens=3, ignore_eos=True))
    s.add_request(request)
    for _ in range(3):
        step(s)
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_tokens == 8


def test_finish_request_for_a_stop_string_frees_blocks():
    s = make_scheduler()
    s.add_request(make_request("r"))
    step(s)
    assert s.finish_request("r", RequestStatus.FINISHED_STOPPED)
    assert not s.finish_request("r", RequestStatus.FINISHED_STOPPED)
    assert s.kv_cache_usage == 0.0 and s.schedule().finished_request_ids == ("r",)
    with pytest.raises(ValueError):
        s.finish_request("x", RequestStatus.RUNNING)


# ---------------------------------------------------------------------- abort
def test_abort_works_in_every_state_and_is_idempotent():
    s = make_scheduler(budget=16)
    running, partial, waiting = make_request("run"), make_request("part", num_prompt=20), make_request("wait")
    for r in (running, partial, waiting):
        s.add_request(r)
    step(s)
    assert (running.status, partial.status, waiting.status) == (
        RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.WAITING)
    for rid in ("run", "part", "wait"):
        assert s.abort_request(rid)
        assert not s.abort_request(rid)
        s.check_invariants()
    assert running.status is RequestStatus.FINISHED_ABORTED
    assert s.kv_cache_usage == 0.0 and not s.has_unfinished_requests()
    assert set(s.schedule().finished_request_ids) == {"run", "part", "wait"}


def test_update_takes_the_latest_output_exactly_once():
    s = make_scheduler()
    s.add_request(make_request("a"))
    out = s.schedule()
    s.update(out, {"a": 5})
    with pytest.raises(ValueError, match="latest"):
        s.update(out, {"a": 5})
    stale, latest = s.schedule(), s.schedule()       # scheduling again without update is harmless
    assert stale.scheduled == latest.scheduled
    with pytest.raises(ValueError, match="latest"):
        s.update(stale, {"a": 5})


def test_abort_between_schedule_and_update_skips_the_request():
    s = make_scheduler(budget=32)
    s.add_request(make_request("a"))
    s.add_request(make_request("b"))
    out = s.schedule()
    s.abort_request("a")
    updated = s.update(out, {"a": 5, "b": 5})
    assert [r.request_id for r in updated] == ["b"]
    s.check_invariants()


# ---------------------------------------------------------------------- prefill role
def test_prefill_role_holds_blocks_until_released():
    s = make_scheduler(role="prefill", budget=8)
    request = make_request("p", num_prompt=10)
    s.add_request(request)
    out, updated = step(s)
    assert updated == [] and s.last_progressed == [request] and request.num_computed_tokens == 8
    out, updated = step(s)
    assert updated == [request] and request.status is RequestStatus.FINISHED_PREFILLED
    assert request.output_token_ids == [7] and len(request.block_ids) == 3
    assert s.kv_cache_usage > 0 and s.num_held_kv == 1 and not s.has_unfinished_requests()
    assert s.get_request("p") is request
    assert s.schedule().finished_request_ids == ("p",)
    assert s.release_request("p") and not s.release_request("p")
    assert s.kv_cache_usage == 0.0 and s.get_request("p") is None
    assert s.schedule().finished_request_ids == ()       # reported once, when it finished


def test_prefill_role_abort_releases_a_held_request():
    s = make_scheduler(role="prefill")
    s.add_request(make_request("p", num_prompt=4))
    step(s)
    assert s.abort_request("p") and not s.abort_request("p")
    assert s.kv_cache_usage == 0.0
    s.check_invariants()


# ---------------------------------------------------------------------- decode role
def test_decode_role_reserves_then_lands_then_decodes():
    s = make_scheduler(role="decode", budget=16)
    request = make_request("d", num_prompt=10, max_tokens=4)
    s.add_remote_request(request)
    assert request.status is RequestStatus.WAITING_FOR_BLOCKS and s.num_waiting == 1
    out, _ = step(s)
    assert out.reserved_request_ids == ("d",) and out.scheduled == ()
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV and len(request.block_ids) == 3
    assert s.num_waiting == 1 and s.prefill_queue_tokens == 0
    assert not s.remote_kv_landed("d", 42)
    assert request.status is RequestStatus.RUNNING and request.output_token_ids == [42]
    assert request.num_computed_tokens == 10 and s.kv_manager.block_pool.num_cached_blocks == 2
    out, updated = step(s)
    assert shape(out) == [("d", 10, 1, True)] and out.scheduled[0].token_ids == (42,)
    assert updated == [request] and request.output_token_ids == [42, 7]


def test_decode_role_landing_can_finish_the_request():
    s = make_scheduler(role="decode")
    request = make_request("d", num_prompt=6)
    s.add_remote_request(request)
    step(s)
    assert s.remote_kv_landed("d", EOS)
    assert request.status is RequestStatus.FINISHED_STOPPED and s.kv_cache_usage == 0.0
    assert s.remote_kv_landed("d", EOS)                  # unknown now: nothing left to run
    s.check_invariants()


def test_decode_role_failed_pull_prefills_locally_ahead_of_newer_requests():
    s = make_scheduler(role="decode", budget=32)
    s.add_request(make_request("filler", num_prompt=31))
    step(s)
    remote = make_request("remote", num_prompt=10)
    s.add_remote_request(remote)
    step(s)
    assert remote.status is RequestStatus.WAITING_FOR_REMOTE_KV
    s.add_request(make_request("newer", num_prompt=10))
    assert s.remote_kv_failed("remote")
    assert not s.remote_kv_failed("remote")                # already falling back
    assert remote.status is RequestStatus.WAITING and remote.block_ids == []
    s.check_invariants()
    out, _ = step(s)
    assert [seq.request_id for seq in out.scheduled] == ["filler", "remote", "newer"]
    assert shape(out)[1] == ("remote", 0, 10, True)


def test_decode_role_failure_while_waiting_for_blocks_and_abort_in_both_states():
    s = make_scheduler(role="decode", num_blocks=4, budget=16)   # 3 usable blocks
    first = make_request("first", num_prompt=9, max_tokens=3)
    second = make_request("second", num_prompt=5, max_tokens=3)
    s.add_remote_request(first)
    s.add_remote_request(second)
    out, _ = step(s)
    assert out.reserved_request_ids == ("first",)        # second waits for blocks (FIFO)
    assert second.status is RequestStatus.WAITING_FOR_BLOCKS
    assert s.remote_kv_failed("second") and second.status is RequestStatus.WAITING
    assert s.abort_request("first") and s.kv_cache_usage == 0.0
    s.add_remote_request(make_request("third", num_prompt=4, max_tokens=3))
    assert s.abort_request("third")
    s.check_invariants()


def test_decode_role_keeps_a_watermark_for_running_decodes():
    s = Scheduler(SchedulerConfig(16, 8, 64), CacheConfig(block_size=4, num_blocks=11),
                  role="decode", reserve_watermark=0.2)          # 10 usable, keep 2 free
    running = make_request("running", num_prompt=8)
    s.add_remote_request(running)
    step(s)
    s.remote_kv_landed("running", 5)                      # holds 2 blocks, 8 free
    s.add_remote_request(make_request("big", num_prompt=28))   # needs 7: would leave 1 < 2
    out, _ = step(s)
    assert out.reserved_request_ids == ()
    s.abort_request("running")
    out, _ = step(s)                                      # nothing runs: no watermark needed
    assert out.reserved_request_ids == ("big",)


# ---------------------------------------------------------------------- intake and stats
def test_add_request_validates_at_the_boundary():
    s = make_scheduler(num_blocks=8, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("long", num_prompt=30, max_tokens=8))
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(make_request("huge", num_prompt=28, max_tokens=4))   # 8 blocks > 7
    s.add_request(make_request("ok"))
    with pytest.raises(ValueError, match="already"):
        s.add_request(make_request("ok"))
    with pytest.raises(ValueError, match="decode"):
        s.add_remote_request(make_request("remote"))
    with pytest.raises(ValueError, match="role"):
        make_scheduler(role="both")
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(SchedulerConfig(), CacheConfig())


def test_stats_follow_the_queues():
    s = make_scheduler(budget=16)
    s.add_request(make_request("a", num_prompt=10))
    s.add_request(make_request("b", num_prompt=20))
    assert s.num_waiting == 2 and s.prefill_queue_tokens == 30
    step(s)                                              # a: 10 (done), b: 6 of 20
    assert s.num_running == 2 and s.num_waiting == 0
    assert s.prefill_queue_tokens == 14
    assert 0 < s.kv_cache_usage < 1 and s.num_free_blocks == 63 - 3 - 2


def test_accepts_a_ready_kv_cache_manager():
    from engine.block_pool import BlockPool
    from engine.kv_cache_manager import KVCacheManager
    manager = KVCacheManager(BlockPool(8), block_size=4)
    s = Scheduler(SchedulerConfig(16, 4, 32), manager, eos_token_ids=(EOS,))
    s.add_request(make_request("a", num_prompt=5, max_tokens=2))
    step(s)
    assert s.kv_manager is manager and manager.usage > 0
