"""KV cache groups (engine/kv_groups/): a mixed local/global model's layers split by window, one
block table per group over one shared pool.

Property test on small schedulers, as `test_window_blocks_properties` does for one window: each
step "writes" every scheduled position's KV into each group's page (the hash of the prefix it
depends on), and before every step each key a scheduled query can see in each group (all of them
in a full group, its window behind the chunk in a local one) must hold exactly that request's
prefix: a prefix hit on a page freed and reused, a freed page still in a window, or tables that
moved apart would all read wrong KV. No page leaks (aborts, preemption, drained), and a local
group never holds more than its window and a chunk span, however long the request runs.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.block_pool import NULL_BLOCK_ID
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_groups.spec import KVGroups, cache_groups, serving_groups
from engine.request import Request
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler
from test_scheduler_properties import MAX_MODEL_LEN, SAMPLED_VOCAB, check_output, draw_request, fits, pick, schedulers


def test_groups_follow_the_window_classes():
    # Gemma 3 27B: 62 layers, every 6th full: 10 full, 52 local -> pages of 10 layers, 1 + 6 groups.
    windows = tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(62))
    groups = KVGroups.for_windows(windows, 62)
    assert groups.slots == 10 and groups.windows == (0,) + (1024,) * 6
    assert groups.layers[0] == (5, 11, 17, 23, 29, 35, 41, 47, 53, 59) and len(groups.layers[-1]) == 2
    placement = groups.placement(62)
    assert placement[5] == (0, 0) and placement[0] == (1, 0) and len(set(placement)) == 62
    # gpt-oss 20b: 12 sliding, 12 full, alternating -> two groups of 12.
    oss = KVGroups.for_windows((128, 0) * 12, 24)
    assert oss.windows == (0, 128) and oss.slots == 12 and oss.layers[0] == tuple(range(1, 24, 2))
    # One class (dense, or Mistral's window everywhere): the single-group cache, unchanged.
    assert KVGroups.for_windows((), 4) == KVGroups.single(4)
    assert KVGroups.for_windows((9,) * 4, 4) == KVGroups.single(4, 9)
    # Every role runs the groups (P/D moves each group's pages); a draft model keeps one group;
    # a cache config must match its model.
    assert all(serving_groups((128, 0) * 2, 4, role, False).is_hybrid for role in ("colocated", "prefill", "decode"))
    assert not serving_groups((128, 0) * 2, 4, "colocated", True).is_hybrid
    assert not serving_groups((128, 0) * 2, 4, "prefill", False, "single").is_hybrid   # --kv-cache-groups single
    with pytest.raises(ValueError, match="do not match"):
        cache_groups((128, 0) * 2, 4, (0, 64))


def _scheduler(group_windows, num_blocks=40, block_size=2, budget=8, prefix=True) -> Scheduler:
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix,
                        kv_group_windows=group_windows)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=80), cache)


def _run(scheduler: Scheduler, request: Request) -> None:
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update(out, {seq.request_id: 1 for seq in out.scheduled if seq.sample})


def test_a_prefix_hit_is_what_every_group_still_holds():
    scheduler = _scheduler((0, 3))
    kv = scheduler.kv_manager
    first = Request("a", list(range(20)), SamplingParams(max_tokens=1))
    _run(scheduler, first)
    again = Request("b", list(range(20)) + [7], SamplingParams(max_tokens=1))
    blocks, tokens = kv.get_computed_blocks(again)
    assert tokens == 20 and len(blocks) == 10      # group 0: every block; the local group: its window
    # The local group freed its pages behind the window while the first request ran (their cache
    # entries live on until reused): evict the page the hit's window needs, and the hit shrinks
    # to the longest prefix both groups still hold.
    local_hit = kv.groups._pending["b"][0]       # the query at 20 reads keys 18.., block 9 on
    assert local_hit[:9] == [NULL_BLOCK_ID] * 9 and local_hit[9] != NULL_BLOCK_ID
    kv.block_pool._evict(local_hit[9])
    blocks, tokens = kv.get_computed_blocks(again)
    assert tokens == 18 and len(blocks) == 9     # the query at 18 reads keys 16.., block 8 on
    _run(scheduler, again)
    scheduler.check_invariants()
    assert scheduler.num_free_blocks == kv.block_pool.num_usable_blocks


def test_a_long_generation_holds_a_window_of_local_pages():
    scheduler = _scheduler((0, 4, 4), num_blocks=80, budget=4)
    kv = scheduler.kv_manager
    request = Request("long", list(range(10)), SamplingParams(max_tokens=50, ignore_eos=True))
    scheduler.add_request(request)
    peak = [0, 0]
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update(out, {seq.request_id: 5 for seq in out.scheduled if seq.sample})
        if not request.is_finished:
            peak = list(map(max, peak, kv.groups.num_held("long")))
            scheduler.check_invariants()
    # 60 tokens are 30 blocks; each local group holds a window and a chunk span at most.
    assert 2 <= min(peak) and max(peak) <= kv.groups.max_blocks_held(30, 4) // 2 == 5
    assert scheduler.num_free_blocks == kv.block_pool.num_usable_blocks


class GroupKV:
    """Each group's cache contents: (group, page, offset) -> hash of the prefix written there."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler, self.bs = scheduler, scheduler.block_size
        self.windows = (0, *scheduler.kv_manager.groups.windows)
        self.slots: dict[tuple[int, int, int], int] = {}

    def tables(self, seq) -> list[tuple[int, ...]]:
        return [seq.block_ids, *self.scheduler.kv_manager.groups.tables[seq.request_id]]

    def write(self, seq, tokens) -> None:
        for g, table in enumerate(self.tables(seq)):
            for p in range(seq.start_position, seq.start_position + len(seq.token_ids)):
                page = table[p // self.bs]
                assert page != NULL_BLOCK_ID, f"group {g} writes position {p} into the null block"
                self.slots[(g, page, p % self.bs)] = hash(tuple(tokens[:p + 1]))

    def check_visible(self, seq, tokens) -> None:
        start = seq.start_position
        for g, table in enumerate(self.tables(seq)):
            assert len(table) == len(seq.block_ids), "the groups' tables grow together"
            window = self.windows[g]
            for p in range(max(0, start - window + 1) if window else 0, start):
                page = table[p // self.bs]
                assert page != NULL_BLOCK_ID, f"group {g}: key {p} in the window of a query at {start} was freed"
                assert self.slots.get((g, page, p % self.bs)) == hash(tuple(tokens[:p + 1])), (
                    f"group {g}: key {p} (page {page}) holds another prefix's KV")

    def check_bound(self) -> None:
        kv, budget = self.scheduler.kv_manager, self.scheduler.config.max_num_batched_tokens
        for request in self.scheduler.running:
            nb = kv.num_blocks_for(request.num_tokens)
            for window, held in zip(self.windows[1:], kv.groups.num_held(request.request_id)):
                assert held <= (min(nb, (window + budget - 2) // self.bs + 2) if window else nb)


@st.composite
def group_windows(draw) -> tuple[int, ...]:
    """One or two full groups, then one to three local ones."""
    local = draw(st.lists(st.sampled_from([1, 2, 3, 5, 8]), min_size=1, max_size=3))
    return (0,) * draw(st.integers(1, 2)) + tuple(sorted(local))


def _step(scheduler: Scheduler, kv: GroupKV, data) -> None:
    out = scheduler.schedule()
    check_output(scheduler, out)
    for seq in out.scheduled:
        kv.check_visible(seq, scheduler.get_request(seq.request_id).token_ids)
        if any(NULL_BLOCK_ID in t for t in kv.tables(seq)[1:]):
            event("a local table freed pages")
    for seq in out.scheduled:
        kv.write(seq, scheduler.get_request(seq.request_id).token_ids)
    scheduler.update(out, {seq.request_id: data.draw(st.integers(0, SAMPLED_VOCAB - 1))
                           for seq in out.scheduled if seq.sample})
    scheduler.check_invariants()
    kv.check_bound()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_groups_never_leak_and_never_serve_stale_kv(data):
    scheduler = data.draw(schedulers("colocated", group_windows=group_windows(), block_sizes=(1, 2, 4)))
    kv = GroupKV(scheduler)
    requests: list[Request] = []
    for i in range(data.draw(st.integers(5, 60))):
        op = data.draw(st.sampled_from(["add", "add", "step", "step", "step", "step", "abort"]))
        if op == "add":
            request = draw_request(data, f"r{i}", arrival=float(i))
            if fits(scheduler, request):
                scheduler.add_request(request)
                requests.append(request)
            else:
                with pytest.raises(ValueError):
                    scheduler.add_request(request)
        elif op == "step":
            _step(scheduler, kv, data)
        elif (rid := pick(data, scheduler.requests)) is not None:
            scheduler.abort_request(rid)
        scheduler.check_invariants()
    if scheduler.kv_manager.num_hit_tokens:
        event("prefix cache hit")
    if scheduler.num_preemptions:
        event("preemption")
    for _ in range(20_000):
        if not scheduler.has_unfinished_requests():
            break
        _step(scheduler, kv, data)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_free_blocks == scheduler.kv_manager.block_pool.num_usable_blocks
    assert not scheduler.kv_manager.groups.tables and all(r.is_finished and not r.block_ids for r in requests)
