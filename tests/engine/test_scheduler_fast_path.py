"""The all-decode fast path of `Scheduler.schedule` against the general path, and the queues'
unordered views: same batches, same blocks, whatever path a step takes."""

from __future__ import annotations

import copy

from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request
from engine.scheduling.request_queue import FCFSQueue, PriorityQueue
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler


def step(scheduler: Scheduler):
    out = scheduler.schedule()
    scheduler.update(out, {s.request_id: 7 for s in out.scheduled if s.sample})
    scheduler.check_invariants()
    return out


def test_fast_and_general_decode_paths_build_the_same_batches():
    fast = Scheduler(SchedulerConfig(64, 16, 256), CacheConfig(block_size=4, num_blocks=200), eos_token_ids=(2,))
    for i in range(6):   # prompts of 3..13 tokens: some decodes cross a block boundary each step
        fast.add_request(Request(f"r{i}", list(range(100 * i, 100 * i + 3 + 2 * i)), SamplingParams(max_tokens=40)))
    step(fast)
    fast.add_request(Request("long", list(range(5000, 5150)), SamplingParams(max_tokens=4)))  # chunked prefill
    general = copy.deepcopy(fast)
    general._decodes_cannot_run_short = lambda budget: False     # always the general path
    grew = 0
    for _ in range(12):
        assert fast._decodes_cannot_run_short(fast.config.max_num_batched_tokens)
        before = {r.request_id: len(r.block_ids) for r in fast.running}
        out_fast, out_general = step(fast), step(general)
        assert out_fast == out_general
        assert fast.num_free_blocks == general.num_free_blocks
        assert [r.request_id for r in fast.last_progressed] == [r.request_id for r in general.last_progressed]
        for seq in out_fast.scheduled:    # each seq carries its table after this step's growth
            request = fast.get_request(seq.request_id)
            if request is not None:
                assert seq.block_ids == tuple(request.block_ids)
                grew += len(request.block_ids) > before.get(seq.request_id, len(request.block_ids))
    assert grew >= 6


def test_unordered_views_hold_every_queued_request():
    fcfs, priority = FCFSQueue(), PriorityQueue()
    requests = [Request(f"r{i}", [1], SamplingParams(), arrival_time=float(i), priority=3 - i % 3) for i in range(7)]
    for request in requests:
        fcfs.push(request)
        priority.push(request)
    assert list(fcfs.unordered()) == requests
    assert sorted(r.request_id for r in priority.unordered()) == sorted(r.request_id for r in requests)
    assert [r.request_id for r in priority] == [r.request_id for r in sorted(
        requests, key=lambda r: (r.priority, r.arrival_time))]
