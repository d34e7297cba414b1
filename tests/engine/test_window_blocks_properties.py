"""Property tests of sliding-window block freeing: no leak, the window freed, and no stale KV.

Random interleavings as in `test_scheduler_properties`, on schedulers whose model has one sliding
window in every layer, with a model of the KV itself: every step "writes" each scheduled
position's KV (the hash of the prefix it depends on) into its block, a decode pod's landed pull
writes the whole prompt, and before every step each key a scheduled query can see (its window
behind the chunk) must hold exactly the KV of that request's prefix: a prefix hit on a block that
was freed and reused, a freed block still in a table's window, or a table entry that moved would
all read wrong KV. After every operation the pool's invariants hold; a table that grew holds no
block behind its window, and no request holds more than its window and one chunk span.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.block_pool import NULL_BLOCK_ID
from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request, RequestStatus
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler
from test_scheduler_properties import SAMPLED_VOCAB, check_output, draw_request, fits, pick, schedulers

WINDOWS = st.sampled_from([1, 2, 3, 5, 8, 13])


class KVModel:
    """What each (block, offset) of the cache holds: the hash of the token prefix whose last
    token's KV was written there (KV at position p depends on tokens[:p + 1])."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.block_size
        self.window = scheduler.kv_manager.sliding_window
        self.slots: dict[tuple[int, int], int] = {}

    def write(self, block_ids, tokens, start: int, end: int) -> None:
        bs = self.block_size
        for p in range(start, end):
            block = block_ids[p // bs]
            assert block != NULL_BLOCK_ID, f"position {p} is written into the null block"
            self.slots[(block, p % bs)] = hash(tuple(tokens[: p + 1]))

    def check_visible(self, block_ids, tokens, start: int) -> None:
        """The keys the first query of a chunk at `start` reads from the cache (the rest of the
        chunk's keys it writes itself) hold this request's KV."""
        bs = self.block_size
        first = 0 if self.window is None else max(0, start - self.window + 1)
        for p in range(first, start):
            block = block_ids[p // bs]
            assert block != NULL_BLOCK_ID, f"key {p} in the window of a query at {start} was freed"
            assert self.slots.get((block, p % bs)) == hash(tuple(tokens[: p + 1])), (
                f"key {p} (block {block}) holds another prefix's KV")

    def check_window_freed(self, seq, table_grew: bool) -> None:
        """A table that grew this step holds no block wholly behind its first query's window
        (freeing runs when a table grows: a decode frees one block per block it adds)."""
        if self.window is None or not table_grew:
            return
        behind = max(0, seq.start_position - self.window + 1) // self.block_size
        held = [b for b in seq.block_ids[:behind] if b != NULL_BLOCK_ID]
        assert not held, f"{seq.request_id} still holds {held} behind its window"

    def check_bound(self) -> None:
        """No colocated request ever holds more blocks than its window and one chunk span."""
        if self.window is None or self.scheduler.role != "colocated":
            return
        kv, budget = self.scheduler.kv_manager, self.scheduler.config.max_num_batched_tokens
        for request in self.scheduler.running:
            held = sum(1 for b in request.block_ids if b != NULL_BLOCK_ID)
            assert held <= kv.max_blocks_held(request.num_tokens, budget), request.request_id


def step(scheduler: Scheduler, kv: KVModel, data) -> None:
    widths = {r.request_id: len(r.block_ids) for r in scheduler.running}
    out = scheduler.schedule()
    check_output(scheduler, out)
    for seq in out.scheduled:
        request = scheduler.get_request(seq.request_id)
        kv.check_visible(seq.block_ids, request.token_ids, seq.start_position)
        kv.check_window_freed(seq, len(seq.block_ids) > widths.get(seq.request_id, 0))
        if seq.start_position and len(seq.token_ids) > 1:
            event("chunk continued or prefix hit")
        if NULL_BLOCK_ID in seq.block_ids:
            event("table with freed blocks")
    sampled = {seq.request_id: data.draw(st.integers(0, SAMPLED_VOCAB - 1)) for seq in out.scheduled if seq.sample}
    # The model runs the whole batch: every scheduled position's KV is written.
    requests = {seq.request_id: scheduler.get_request(seq.request_id) for seq in out.scheduled}
    for seq in out.scheduled:
        kv.write(seq.block_ids, requests[seq.request_id].token_ids, seq.start_position,
                 seq.start_position + len(seq.token_ids))
    scheduler.update(out, sampled)
    scheduler.check_invariants()
    kv.check_bound()


def land(scheduler: Scheduler, kv: KVModel, rid: str, token: int) -> None:
    """The pull moved the prompt's blocks from `first_block_in_window` on: all it writes."""
    request, manager = scheduler.get_request(rid), scheduler.kv_manager
    start = manager.first_block_in_window(request.num_prompt_tokens)
    assert request.block_ids[:start] == [NULL_BLOCK_ID] * start and NULL_BLOCK_ID not in request.block_ids[start:]
    kv.write(request.block_ids, request.token_ids, start * kv.block_size, request.num_prompt_tokens)
    scheduler.remote_kv_landed(rid, token)


@pytest.mark.parametrize("role", ["colocated", "decode"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_window_freeing_never_leaks_and_never_serves_stale_kv(role, data):
    scheduler = data.draw(schedulers(role, WINDOWS))
    kv = KVModel(scheduler)
    requests: list[Request] = []
    ops = ["add", "add", "step", "step", "step", "step", "abort"]
    if role == "decode":
        ops += ["add_remote", "add_remote", "land", "land", "fail"]
    for i in range(data.draw(st.integers(5, 60))):
        op = data.draw(st.sampled_from(ops))
        if op in ("add", "add_remote"):
            request = draw_request(data, f"r{i}", arrival=float(i))
            if fits(scheduler, request):
                (scheduler.add_request if op == "add" else scheduler.add_remote_request)(request)
                requests.append(request)
        elif op == "step":
            step(scheduler, kv, data)
        elif op == "abort":
            rid = pick(data, scheduler.requests)
            if rid is not None:
                scheduler.abort_request(rid)
        elif op == "land":
            rid = pick(data, scheduler.waiting_for_remote_kv)
            if rid is not None:
                land(scheduler, kv, rid, data.draw(st.integers(0, SAMPLED_VOCAB - 1)))
        elif op == "fail":
            rid = pick(data, list(scheduler.waiting_for_remote_kv) + [r.request_id for r in scheduler.waiting_for_blocks])
            if rid is not None:
                scheduler.remote_kv_failed(rid)
        scheduler.check_invariants()
    if scheduler.kv_manager.num_hit_tokens:
        event("prefix cache hit")
    for _ in range(20_000):    # drain: everything finishes, nothing stays referenced
        for rid in list(scheduler.waiting_for_remote_kv):
            land(scheduler, kv, rid, 5)
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, kv, data)
    assert not scheduler.has_unfinished_requests()
    scheduler.check_invariants()
    assert scheduler.num_free_blocks == scheduler.kv_manager.block_pool.num_usable_blocks
    assert all(r.is_finished and not r.block_ids for r in requests)


def test_prefill_role_frees_behind_the_window_and_keeps_what_the_pull_sends():
    """A long prompt in chunks holds about a window (plus a chunk) of blocks on a prefill pod, and
    every block a pull sends (from `first_block_in_window(prompt)` on) holds the prompt's KV."""
    cache = CacheConfig(block_size=2, num_blocks=40, sliding_window=3)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=4, max_model_len=40), cache, role="prefill")
    manager, kv = scheduler.kv_manager, KVModel(scheduler)
    request = Request("p", list(range(20)), SamplingParams(max_tokens=1))
    scheduler.add_request(request)
    while request.status is not RequestStatus.FINISHED_PREFILLED:
        out = scheduler.schedule()
        for seq in out.scheduled:
            kv.check_visible(seq.block_ids, request.token_ids, seq.start_position)
            kv.write(seq.block_ids, request.token_ids, seq.start_position, seq.start_position + len(seq.token_ids))
        scheduler.update(out, {seq.request_id: 1 for seq in out.scheduled if seq.sample})
        held = sum(1 for b in request.block_ids if b != NULL_BLOCK_ID)
        assert held <= manager.max_blocks_held(request.num_prompt_tokens, 4) == 4
    start = manager.first_block_in_window(20)
    assert start == 9 and NULL_BLOCK_ID not in request.block_ids[start:]
    assert request.block_ids[:7] == [NULL_BLOCK_ID] * 7    # behind the last chunk's first query
    kv.check_visible(request.block_ids, request.token_ids, 20)   # the decode pod's first query
    scheduler.release_request("p")
    assert scheduler.num_free_blocks == manager.block_pool.num_usable_blocks
