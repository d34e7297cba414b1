"""LoRASlots: which adapter sits in which slot, who holds it, what gets copied; and the
scheduler's use of it (at most `max_loras` adapters per batch, waiting at the head of the line)."""

from __future__ import annotations

import random

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.lora.request import LoRARequest
from engine.lora.slots import LoRASlots
from engine.request import Request
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler


def _req(request_id: str, adapter: str | None, prompt_len: int = 4, max_tokens: int = 3) -> Request:
    lora = None if adapter is None else LoRARequest(adapter, f"{ord(adapter[0]):032x}", adapter=f"host-{adapter}")
    return Request(request_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens,
                                                                               ignore_eos=True), lora=lora)


# (operation, request id, adapter) -> expected (slot or can_acquire answer), and the loads queued after it.
CASES = {
    "first use loads, reuse does not": (2, [
        ("acquire", "r1", "a", 0, [(0, "host-a")]),
        ("acquire", "r2", "a", 0, []),
        ("acquire", "r3", "b", 1, [(1, "host-b")]),
    ]),
    "an idle adapter stays resident": (2, [
        ("acquire", "r1", "a", 0, [(0, "host-a")]),
        ("release", "r1", None, None, []),
        ("acquire", "r2", "a", 0, []),
    ]),
    "empty slots before evicting an idle adapter": (2, [
        ("acquire", "r1", "a", 0, [(0, "host-a")]),
        ("release", "r1", None, None, []),
        ("acquire", "r2", "b", 1, [(1, "host-b")]),
    ]),
    "least recently used idle adapter is evicted": (2, [
        ("acquire", "r1", "a", 0, [(0, "host-a")]),
        ("acquire", "r2", "b", 1, [(1, "host-b")]),
        ("release", "r2", None, None, []),
        ("release", "r1", None, None, []),          # a released last: b is the LRU
        ("acquire", "r3", "c", 1, [(1, "host-c")]),
        ("acquire", "r4", "a", 0, []),
    ]),
    "full of running adapters: wait": (1, [
        ("acquire", "r1", "a", 0, [(0, "host-a")]),
        ("can", "r2", "b", False, []),
        ("can", "r3", "a", True, []),
        ("release", "r1", None, None, []),
        ("can", "r2", "b", True, []),
    ]),
    "acquire and release are idempotent": (1, [
        ("acquire", "r1", "a", 0, [(0, "host-a")]),
        ("acquire", "r1", "a", 0, []),
        ("release", "r1", None, None, []),
        ("release", "r1", None, None, []),
    ]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_slot_assignment(case):
    num_slots, steps = CASES[case]
    slots = LoRASlots(num_slots)
    for op, rid, adapter, expected, loads in steps:
        if op == "release":
            slots.release(rid)
        else:
            request = _req(rid, adapter)
            result = slots.acquire(request) if op == "acquire" else slots.can_acquire(request)
            assert result == expected, f"{case}: {op} {rid} ({adapter})"
        assert [(s, a) for s, a in slots.take_loads()] == loads, f"{case}: loads after {op} {rid}"
        slots.check_invariants()


def test_scheduler_keeps_at_most_max_loras_adapters_per_batch_and_loses_nothing():
    """Random arrivals over 5 adapters and the base model with 2 slots: no step holds more than 2
    adapters, every request finishes, and no slot is held at the end."""
    slots = LoRASlots(2)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=6),
                      CacheConfig(block_size=4, num_blocks=40), lora_slots=slots)
    rng = random.Random(0)
    pending = [_req(f"r{i}", rng.choice([None, "a", "b", "c", "d", "e"]), rng.randint(2, 12), rng.randint(1, 6))
               for i in range(40)]
    finished = set()
    for _ in range(2000):
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add_request(pending.pop())
        out = sched.schedule()
        batch = {sched.requests[s.request_id].lora.identity for s in out.scheduled
                 if sched.requests[s.request_id].lora is not None}
        assert len(batch) <= 2
        for seq in out.scheduled:   # every scheduled adapter request holds its adapter's slot
            req = sched.requests[seq.request_id]
            if req.lora is not None:
                assert slots.identity[slots.slot_of_request[seq.request_id]] == req.lora.identity
        slots.take_loads()
        done = sched.update(out, {s.request_id: 7 for s in out.scheduled if s.sample})
        finished |= {r.request_id for r in done if r.is_finished}
        sched.check_invariants()
        slots.check_invariants()
        if not pending and not sched.has_unfinished_requests():
            break
    assert len(finished) == 40 and not slots.slot_of_request
