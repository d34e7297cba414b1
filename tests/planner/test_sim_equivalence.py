"""The simulator schedules exactly the batches the real engine schedules.

The same requests (shared prefixes, chunked prompts, a KV pool small enough to preempt) arrive at
the same virtual instants at a real `Engine` (tiny weights, real runner and sampler), stepped by
hand with each step lasting what the cost model says, and at a simulated pod (`SimPod` on the
virtual-time loop, with the same cost model). Their `SchedulerOutput`s must agree step by step:
the same sequences, chunk lengths, start positions, block tables and sample flags, the same
preemptions, reservations and endings, at the same instants. Colocated, prefill (blocks held until
a pull releases them) and decode (blocks reserved, KV landing later) roles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch

from cbserve.planner.cost_model import FEATURES, StepCostModel
from cbserve.planner.sim_pod import PodCosts, SimPod
from cbserve.planner.virtual_loop import run_virtual
from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.request import Request
from engine.sampling.params import SamplingParams
from engine.telemetry.step_shape import StepShape

# Any fixed costs will do: both sides must step at the same instants.
COST = StepCostModel(tuple([0.004, 0.03] + [0.0] * (len(FEATURES) - 2)))
SCHEDULER = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=6, max_model_len=512)
CACHE = CacheConfig(block_size=16, num_blocks=16)       # small: long runs preempt
TRANSFER_S = 0.0137                                      # reserve -> KV landed; first token -> released


def _requests(seed: int, count: int = 10) -> list[tuple[float, str, list[int], int]]:
    """A burst of long answers that outgrows the pool (preemptions), then a random tail."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(48)]
    t, out = 0.0, []
    for i in range(4):
        t += 0.001
        out.append((t, f"b{i}", [rng.randrange(3, 250) for _ in range(40)], 50))
    for i in range(count):
        t += rng.expovariate(80.0)
        own = [rng.randrange(3, 250) for _ in range(rng.randint(2, 60))]
        prompt = (shared[:rng.choice((16, 32, 48))] if rng.random() < 0.5 else []) + own
        out.append((t, f"r{i}", prompt, rng.choice((1, 8, 30))))
    return out


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _plan(out, t: float, kv) -> tuple:
    """A step as both sides must agree on it (token values aside: sampled ones differ, the real model's
    against the simulator's placeholder), with each sequence's KV-group tables (none for one group)."""
    seqs = tuple((s.request_id, len(s.token_ids), s.start_position, s.block_ids, s.sample,
                  kv.group_tables(s.request_id)) for s in out.scheduled)
    return (round(t, 9), seqs, out.preempted_request_ids, out.reserved_request_ids, out.finished_request_ids)


def drive_engine(engine: Engine, role: str, requests) -> list[tuple]:
    """The engine thread's loop by hand, on a virtual clock: commands due, then a step of COST."""
    events = [(t, "add", rid, prompt, n) for t, rid, prompt, n in requests]
    t, steps, last = 0.0, [], None
    while events or engine.has_unfinished_requests():
        events.sort(key=lambda e: e[0])
        ran = False
        while events and events[0][0] <= t:
            _, kind, rid, prompt, n = events.pop(0)
            ran = True
            if kind == "add":
                engine.add_request(prompt, _params(n), request_id=rid, remote_kv=role == "decode")
            elif kind == "land":
                engine.land_remote_kv(rid, 97)
            else:
                engine.scheduler.release_request(rid)
        idle = not engine.has_unfinished_requests() or (last is not None and not last.scheduled and not ran)
        if idle:
            if not events:
                break
            t, last = max(t, events[0][0]), None
            continue
        held = set(engine.scheduler.held)
        engine.step()
        out = last = engine.last_schedule
        if out.scheduled:
            t += COST.seconds(StepShape.of(out))
        steps.append(_plan(out, t, engine.scheduler.kv_manager))
        for rid in out.reserved_request_ids:
            events.append((t + TRANSFER_S, "land", rid, None, None))
        for rid in [r for r in engine.scheduler.held if r not in held]:   # in the order they finished
            events.append((t + TRANSFER_S, "release", rid, None, None))
    return steps


def drive_sim(role: str, requests, cache: CacheConfig = CACHE) -> list[tuple]:
    async def main() -> list[tuple]:
        loop = asyncio.get_running_loop()
        steps = []

        def on_step(pod: SimPod, out, updated) -> None:
            now = loop.time()
            steps.append(_plan(out, now, pod.scheduler.kv_manager))
            for rid in out.reserved_request_ids:
                loop.call_at(now + TRANSFER_S, pod.submit, lambda r=rid: pod.scheduler.remote_kv_landed(r, 97))
            for request in updated:
                if request.request_id in pod.scheduler.held:
                    loop.call_at(now + TRANSFER_S, pod.submit,
                                 lambda r=request.request_id: pod.scheduler.release_request(r))

        pod = SimPod("pod-0", role, SCHEDULER, cache, PodCosts(COST), on_step, loop.time)
        task = loop.create_task(pod.run())
        for t, rid, prompt, n in requests:
            request = Request(rid, list(prompt), _params(n), t)
            add = pod.scheduler.add_remote_request if role == "decode" else pod.scheduler.add_request
            loop.call_at(t, pod.submit, lambda a=add, r=request: a(r))
        end = requests[-1][0]
        while loop.time() <= end or pod.scheduler.has_unfinished_requests() or pod.scheduler.held or pod.commands:
            await asyncio.sleep(0.05)
        task.cancel()
        assert pod.stats.num_steps == sum(1 for s in steps if s[1])
        return steps
    return run_virtual(main())


@pytest.fixture(params=["colocated", "prefill", "decode"])
def engine_and_role(request):
    """A fresh engine per test: the pool's free-block order must start as the simulated pod's does."""
    role = request.param
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as a pod runs; two threads on a busy two-core machine crawl
    engine = Engine(EngineConfig(model="tiny", role="decode" if role == "colocated" else role,
                                 max_model_len=SCHEDULER.max_model_len, cache=CACHE, scheduler=SCHEDULER))
    yield engine, role
    engine.close()
    torch.set_num_threads(threads)


@pytest.mark.parametrize("seed", [0, 1])
def test_simulated_pod_schedules_what_the_engine_schedules(engine_and_role, seed):
    engine, role = engine_and_role
    requests = _requests(seed)
    real = drive_engine(engine, role, requests)
    simulated = drive_sim(role, requests)
    assert len(real) > 10
    for i, (a, b) in enumerate(zip(real, simulated)):
        assert a == b, f"step {i} differs:\nengine    {a}\nsimulator {b}"
    assert len(real) == len(simulated)
    if role != "prefill":
        assert any(step[2] for step in real), "no preemption: the test's pool is not small enough"
    engine.scheduler.check_invariants()
    assert not engine.scheduler.requests


def test_costs_are_the_cost_models():
    assert dataclasses.replace(PodCosts(COST), contention=2.0).model is COST
