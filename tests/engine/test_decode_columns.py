"""The steady decode path as columns (`engine.decode_columns`) plans exactly what the general path plans.

Two schedulers, one with columns and one without, run the same random async workload in lockstep,
as the engine drives them: schedule step N, resolve step N-1's placeholders (tokens that are now
and then eos or a request's stop token), update step N with placeholders; between steps requests
arrive, are aborted or end on a "stop string". Pools that are sometimes short (preemption, the
general path) and batches on both sides of `COLUMNS_MIN_BATCH`. After every operation the two
must agree on every `SchedulerOutput` (read as `ScheduledSeq`s), every returned request and every
request's state, and a reused `StepInputs` staged from the columns must hold what one staged from
the `ScheduledSeq`s holds.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import engine.scheduling.scheduler as scheduler_module
from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request, RequestStatus
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.output import DecodeSeqs, sampled_requests
from engine.step_inputs import PrevSample, StepInputs, max_layout_bytes

EOS, STOP, VOCAB = 2, 6, 40
MAX_MODEL_LEN, WIDTH = 96, 24


def _state(r: Request) -> tuple:
    return (r.request_id, r.status, r.num_computed_tokens, list(r.token_ids), list(r.output_token_ids),
            list(r.block_ids), r.first_token_time, r.finished_time, r.stop_reason)


def _staged(inputs: StepInputs, scheduled, prev: PrevSample | None, pad_to: int) -> dict:
    t = inputs.prepare(scheduled, pad_to=pad_to, width=WIDTH, prev_rows=prev)
    views = inputs._host_views(t.layout)
    fields = {name: views[name].tolist() for name in ("input_ids", "positions", "slot_mapping", "query_start_loc",
                                                    "seq_lens", "block_tables", "logits_indices")}
    n = t.layout.num_fill
    dst, src = (np.arange(n), np.arange(n)) if t.fill_in_order else (views["fill_dst"], views["fill_src"])
    fields["fill"] = sorted(zip(dst.tolist(), src.tolist()))
    return {"layout": t.layout, **fields}


class Side:
    """One scheduler driven as the async engine drives it."""

    def __init__(self, columns: bool, config: SchedulerConfig, cache: CacheConfig, clock) -> None:
        self.scheduler = Scheduler(config, cache, eos_token_ids=(EOS,), clock=clock)
        self.scheduler.decode_columns = columns
        self.requests: dict[str, Request] = {}
        self.in_flight: tuple[list[Request], list[str]] | None = None
        self.inputs = StepInputs(max_layout_bytes(config.max_num_batched_tokens, config.max_num_seqs, WIDTH), 4,
                                 torch.device("cpu"))

    def step(self, token_of, seen: dict) -> tuple:
        s = self.scheduler
        out = s.schedule()
        seen["columns"] += isinstance(out.scheduled, DecodeSeqs)
        scheduled = s.scheduled_requests
        sampled, ids = sampled_requests(out.scheduled, scheduled)
        staged = None
        decode_only = out.scheduled and out.num_batched_tokens == len(out.scheduled)
        if decode_only and len(out.scheduled) <= s.config.max_num_seqs:
            prev = None if self.in_flight is None else PrevSample(torch.zeros(len(self.in_flight[1]), dtype=torch.long),
                                                                  ids=self.in_flight[1])
            staged = _staged(self.inputs, out.scheduled, prev, s.config.max_num_seqs)
        resolved = None
        if self.in_flight is not None:
            requests = self.in_flight[0]
            resolved = s.resolve_placeholders(requests, [token_of(r) for r in requests])
        updated = s.update(out, None)
        self.in_flight = (updated, ids) if updated else None
        plan = (tuple(out.scheduled), out.num_batched_tokens, out.preempted_request_ids, out.reserved_request_ids,
                out.finished_request_ids)
        return (plan, [r.request_id for r in scheduled], [r.request_id for r in sampled], ids, staged,
                None if resolved is None else [r.request_id for r in resolved], [r.request_id for r in updated],
                [r.request_id for r in s.last_progressed])


@pytest.mark.parametrize("seed", range(6))
def test_columns_and_the_general_path_plan_the_same_steps(seed, monkeypatch):
    rng = random.Random(seed)
    small = seed % 2 == 1       # small batches, taking columns too; else bursts past COLUMNS_MIN_BATCH
    if small:
        monkeypatch.setattr(scheduler_module, "COLUMNS_MIN_BATCH", 1)
    block_size = 4
    max_num_seqs = rng.choice([3, 6]) if small else 24
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN)
    cache = CacheConfig(block_size=block_size, num_blocks=rng.choice([40, 400] if small else [200, 400]),
                        enable_prefix_caching=rng.random() < 0.7)
    now = [0.0]
    sides = [Side(True, config, cache, lambda: now[0]), Side(False, config, cache, lambda: now[0])]

    def token_of(request: Request) -> int:     # the same "sample" on both sides
        return random.Random(f"{request.request_id}/{len(request.output_token_ids)}").randrange(3, VOCAB) \
            if rng_tokens.random() > 0.04 else rng_tokens.choice([EOS, STOP])

    seen = {"columns": 0}
    for op in range(260):
        now[0] += 1.0
        choice = rng.random()
        if choice < 0.1 or not sides[0].scheduler.has_unfinished_requests():
            for i in range(1 if small or rng.random() < 0.7 else 12):
                rid = f"r{op}.{i}"
                prompt = [1] + [rng.randrange(3, 9) for _ in range(rng.randrange(1, 12))]
                params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 70), ignore_eos=rng.random() < 0.3,
                                        stop_token_ids=[STOP] if rng.random() < 0.3 else [],
                                        min_tokens=rng.choice([0, 0, 1]))
                for side in sides:
                    req = Request(rid, list(prompt), params, arrival_time=now[0])
                    side.requests[rid] = req
                    side.scheduler.add_request(req)
        elif choice < 0.16:
            rid = rng.choice(sorted(sides[0].requests))
            assert len({side.scheduler.abort_request(rid) for side in sides}) == 1
        elif choice < 0.19:
            rid = rng.choice(sorted(sides[0].requests))
            assert len({side.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED) for side in sides}) == 1
        else:
            seed_tokens = rng.random()
            results = []
            for side in sides:
                rng_tokens = random.Random(seed_tokens)
                results.append(side.step(token_of, seen))
            assert results[0] == results[1], f"op {op}"
        for side in sides:
            side.scheduler.check_invariants()
        assert [_state(r) for r in sides[0].requests.values()] == [_state(r) for r in sides[1].requests.values()]
        kv = [side.scheduler.kv_manager for side in sides]      # the same blocks registered for prefix hits
        assert kv[0]._num_cached_blocks == kv[1]._num_cached_blocks
        assert kv[0].block_pool.cached_blocks == kv[1].block_pool.cached_blocks
    assert seen["columns"] > 10        # the columns path ran (and the general one, on the other side)
