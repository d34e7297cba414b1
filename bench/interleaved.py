"""Engines measured side by side, step by step: the way this repo's benches compare arms on a
shared host, where the load moves faster than a whole batch runs.

Each arm's engine is given the same batch of requests at once; then the engines take turns, one
`Engine.step` each, so a change in the host's load lands on all arms alike. The order runs through
every permutation of the arms in turn, so each arm follows every other equally often: a step pays
for what the step before it left in the caches (a grammar arm's matchers, another model's
weights), and with a plain rotation of three arms one arm would always follow the same one.
Each arm's clock is the sum of its own steps' times (all the host work of a step included). TPOT
is each request's (clock at its last token - at its first) / (tokens - 1), averaged over the
batch; throughput is output tokens / the arm's clock.

With `concurrency` the requests are not added at once: each arm keeps that many running, adding
the next as one finishes (a server at a fixed concurrency, `vllm bench serve --max-concurrency`).
A batch added at once ends in a drain, the batch shrinking a request at a time, and an arm whose
requests finish at different steps (speculation) drains through small, dear steps a closed batch
of plain steps never runs; `steady_throughput` counts only the tokens and seconds up to the last
request's admission, while every slot was full.

Used by `bench/spec_decode.py` (plain vs speculative engines) and `bench/structured_overhead.py`
(unconstrained vs grammar-constrained engines, and free vs free for the noise floor).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class ArmRun:
    """One arm's batch: its clock and, per request id, its tokens and the clock at its first and
    last output."""

    clock: float = 0.0
    tokens: dict[str, list[int]] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)

    @property
    def tpot(self) -> float:
        """Mean seconds per output token after the first."""
        return statistics.mean((self.last[r] - self.first[r]) / (len(t) - 1)
                               for r, t in self.tokens.items() if len(t) > 1)

    steady_clock: float = 0.0      # the clock and the tokens out when the last request was added
    steady_tokens: int = 0

    @property
    def throughput(self) -> float:
        """Output tokens per second of the arm's own clock."""
        return sum(map(len, self.tokens.values())) / self.clock

    @property
    def steady_throughput(self) -> float:
        """Output tokens per second until the last request was added (all of the run where every
        request was added at once: then it is `throughput`)."""
        return self.steady_tokens / self.steady_clock if self.steady_clock > 0 else self.throughput


def run_interleaved(engines: dict, prompts: list, params: list | dict[str, list],
                    concurrency: int | None = None) -> dict[str, ArmRun]:
    """One batch (`prompts[i]` with `params[i]`, or `params[arm][i]` per arm) per engine, every
    request added at once (or `concurrency` at a time, in order: the module docstring); the engines
    step in turns until all are done."""
    arms = list(engines)
    runs = {arm: ArmRun() for arm in arms}
    pending = {arm: list(zip(prompts, params[arm] if isinstance(params, dict) else params))[::-1] for arm in arms}

    def admit(arm: str, count: int) -> None:
        run = runs[arm]
        for _ in range(min(count, len(pending[arm]))):
            run.tokens[engines[arm].add_request(*pending[arm].pop()).request_id] = []
        if not pending[arm] and concurrency is not None and not run.steady_clock:
            run.steady_clock, run.steady_tokens = run.clock, sum(map(len, run.tokens.values()))

    for arm in arms:
        admit(arm, len(prompts) if concurrency is None else concurrency)
    orders = list(itertools.permutations(arms))
    turn = 0
    while any(e.has_unfinished_requests() for e in engines.values()):
        turn += 1
        for arm in orders[turn % len(orders)]:
            engine = engines[arm]
            if not engine.has_unfinished_requests():
                continue
            run = runs[arm]
            start = time.perf_counter()
            outputs = engine.step()
            now = run.clock = run.clock + time.perf_counter() - start
            for out in outputs:
                if out.new_token_ids:
                    run.first.setdefault(out.request_id, now)
                    run.last[out.request_id] = now
                    run.tokens[out.request_id] += out.new_token_ids
            if pending[arm]:
                admit(arm, sum(out.finished for out in outputs))
    return runs
