"""Scheduler overhead without a model: microseconds per `schedule()` + `update()` step.

Holds `--num-requests` decode requests (contexts of a few hundred tokens) running at once and
times whole steps with fake sampled tokens. Prints mean / p50 / p99 µs per step, split into
schedule() and update(), and, for scale, what copying every block table would cost (the part of
the contract whose cost grows with context length; `schedule()` reuses the KV manager's cached
tuples, rebuilt only when a table grows).

    .venv/bin/python bench/scheduler_overhead.py [--num-requests 256] [--rounds 10] [--steps 200] [--wall]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler


def build(num_requests: int, block_size: int, max_tokens: int, seed: int) -> Scheduler:
    """A scheduler whose requests have all finished their prefill: every later step is pure decode."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(32000) for _ in range(rng.randint(200, 400))] for _ in range(num_requests)]
    max_len = max(map(len, prompts)) + max_tokens
    num_blocks = num_requests * (-(-max_len // block_size)) + 16
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=num_requests, max_model_len=max_len),
        CacheConfig(block_size=block_size, num_blocks=num_blocks),
        eos_token_ids=(),
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"r{i}", prompt, params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running) or scheduler.waiting:
        step(scheduler)
    return scheduler


def step(scheduler: Scheduler) -> None:
    out = scheduler.schedule()
    scheduler.update(out, {s.request_id: 7 for s in out.scheduled if s.sample})


def measure(scheduler: Scheduler, steps: int, clock=time.thread_time) -> dict[str, list[float]]:
    """Per-step microseconds of schedule() and update(); the fake sampler's dict is built outside.

    The default clock is this thread's CPU time, so that other processes on a shared machine do
    not inflate the numbers (`--wall` uses perf_counter instead)."""
    times: dict[str, list[float]] = {"schedule()+update()": [], "  schedule()": [], "  update()": [],
                                      "(for scale) copying every table": []}
    for _ in range(steps):
        t0 = clock()
        out = scheduler.schedule()
        t1 = clock()
        sampled = {s.request_id: 7 for s in out.scheduled if s.sample}
        t2 = clock()
        scheduler.update(out, sampled)
        t3 = clock()
        # The part of ScheduledSeq that grows with context, were the tables copied every step.
        [tuple(r.block_ids) for r in scheduler.running]
        t4 = clock()
        times["schedule()+update()"].append((t1 - t0 + t3 - t2) * 1e6)
        times["  schedule()"].append((t1 - t0) * 1e6)
        times["  update()"].append((t3 - t2) * 1e6)
        times["(for scale) copying every table"].append((t4 - t3) * 1e6)
    return times


def report(label: str, times: list[float]) -> None:
    times = sorted(times)
    p = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    print(f"{label:<34} mean {statistics.fmean(times):7.1f} µs   p50 {p(0.5):7.1f} µs   p99 {p(0.99):7.1f} µs")


def calibration_ms() -> float:
    """Milliseconds for an empty million-iteration loop, to compare machines (~13 ms on a recent
    desktop core with CPython 3.11)."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(1_000_000):
            pass
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10, help="fresh request sets, each timed for --steps")
    parser.add_argument("--steps", type=int, default=200, help="decode steps per round (contexts grow by this)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wall", action="store_true", help="wall-clock time instead of thread CPU time")
    args = parser.parse_args()
    clock = time.perf_counter if args.wall else time.thread_time
    times: dict[str, list[float]] = {}
    contexts: list[int] = []
    for round_ in range(args.rounds):
        # Fresh requests each round keep contexts at a few hundred tokens; enough max_tokens that
        # nobody finishes while timed.
        scheduler = build(args.num_requests, args.block_size, args.steps + 20, args.seed + round_)
        for _ in range(10):   # warm-up
            step(scheduler)
        contexts += [r.num_tokens for r in scheduler.running]
        for label, samples in measure(scheduler, args.steps, clock).items():
            times.setdefault(label, []).extend(samples)
        contexts += [r.num_tokens for r in scheduler.running]
    print(f"{args.num_requests} running decodes, contexts {min(contexts)}..{max(contexts)} tokens, "
          f"block size {args.block_size}, {args.rounds}x{args.steps} steps; "
          f"calibration loop {calibration_ms():.1f} ms; {'wall' if args.wall else 'thread CPU'} time")
    for label, samples in times.items():
        report(label, samples)


if __name__ == "__main__":
    main()
