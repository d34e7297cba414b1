"""Pods that share a machine's cores: each step's slow-down from what else wants a core meanwhile.

On a CPU deployment whose pods, router and client share a few cores (this project's 2-core box:
`LocalCluster`, `bench/goodput.py`), a pod's step takes its profiled CPU seconds only while it has
a core to itself. The kernel's scheduler shares the cores max-min fairly: what wants less than an
equal share (the serving path's threads, a pod that steps now and then) gets all it wants, and
the processes that want more split what is left equally; a step's wall time is its CPU time over
the share of a core its pod gets (`fair_share`). Measured by thread (`CBSERVE_STEP_TRACE`,
`bench/step_check.py`) at 10 req/s on 2 cores, each engine thread's step wall over its CPU against
max-min from the run's own loads: colocated-2 1.33-1.37 (max-min 1.36, c/n 1.24), 1P+1D prefill
1.44 (1.40; c/n 1.25) and decode 1.11 (1.00; c/n 1.00), colocated-3 1.90-2.20 (2.00; c/n 1.73),
2P+1D prefill 1.72-1.78 (1.73-1.79; c/n 1.45) and decode 1.31 (1.34; c/n 1.13). The serving
path's threads each want a small part of a core and get it; the old rule, a step at c/n for n
processes wanting, slowed them as much as the engines and left the engines' steps 10-20% short at
a knee.
What wants a core:
- this pod (one torch thread: one core while it steps);
- every other pod, for the share of the last `window_s` it spent in steps;
- the serving path (the router's HTTP, SSE and routing, the pods' gRPC servers, their engine
  cores' message writer, the client): `serving_cores` all the time (load reports every 50 ms,
  the loops' timers, keep-alives: a cluster with nothing to do uses it too) and `cpu_per_token_s`
  CPU seconds per token streamed to the client, over the same window (measured in situ from the
  processes' CPU seconds of stage B's runs at several token rates: one per-token cost from the
  calibration run alone, 1.8 ms at 178 tokens/s on tiny, made the serving path want 3.7 cores at
  2044 tokens/s, where it used 0.72; base 0.3 cores and 0.2 ms a token fit all three). It is all
  the CPU the processes used less what the pods' engine threads used, not less the profiled cost
  of the steps: a step in situ takes more CPU than the profiler's (caches and the sibling
  hyperthread shared), and that excess is already in each role's contention factor; counted as
  serving work too, it made two colocated pods in overload want a core more than they do. A
  disaggregated cluster's serving path costs more per token (two RPCs per request, the KV pull)
  than a colocated one's: each is measured on its own in-situ run.
So contention is a property of the deployment's co-location and of the traffic at that moment,
not a constant: a colocated pair near its knee, both pods stepping and the router streaming
hundreds of tokens a second, is slowed more than the same pair at a tenth of the rate. What the
share does not explain (caches and memory bandwidth shared, the timer's own gap) stays in each
role's constant contention factor, fitted on top of it (`in_situ._fit_contention`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CpuShareCosts:
    """The cores the processes share (0: every pod has its own device) and the serving path's CPU."""

    cores: float = 0.0
    cpu_per_token_s: float = 0.0                    # disaggregated clusters
    colocated_cpu_per_token_s: float | None = None  # colocated ones (None: the same)
    window_s: float = 1.0
    serving_cores: float = 0.0                      # the serving path's CPU whatever it streams: disaggregated
    colocated_serving_cores: float | None = None    # ... colocated (None: the same)

    def of(self, colocated: bool) -> CpuShareCosts:
        """The costs of one cluster: `cpu_per_token_s` and `serving_cores` are its kind's."""
        if not colocated:
            return self
        per_token, base = self.colocated_cpu_per_token_s, self.colocated_serving_cores
        return replace(self, cpu_per_token_s=self.cpu_per_token_s if per_token is None else per_token,
                       serving_cores=self.serving_cores if base is None else base)


class _Window:
    """One pod's steps (start, end), one after another, and their seconds inside the last window."""

    __slots__ = ("spans", "total")

    def __init__(self) -> None:
        self.spans: deque[tuple[float, float]] = deque()
        self.total = 0.0

    def add(self, start: float, end: float) -> None:
        self.spans.append((start, end))
        self.total += end - start

    def seconds(self, now: float, window_s: float) -> float:
        spans, since = self.spans, now - window_s
        while spans and spans[0][1] <= since:
            start, end = spans.popleft()
            self.total -= end - start
        if not spans:
            return 0.0
        # Steps do not overlap: only the oldest can start before the window, only the newest end after now.
        return max(0.0, self.total - max(0.0, since - spans[0][0]) - max(0.0, spans[-1][1] - now))


def fair_share(others: list[float], cores: float) -> float:
    """The cores a process wanting a whole one gets beside processes wanting `others` (in cores,
    each at most what it can use), max-min fairly: the smallest wants are met while they are
    below an equal split of what is left, the rest split it equally. Above 0 for any `cores` > 0:
    a want is taken out only when it is at most that split."""
    budget, left = cores, len(others) + 1
    for want in sorted(others):
        level = budget / left
        if want > level:
            return min(1.0, level)
        budget -= want
        left -= 1
    return min(1.0, budget)


class CpuShare:
    """One machine's cores, shared by the pods of a `SimCluster` (`factor` before every step)."""

    def __init__(self, costs: CpuShareCosts, clock: Callable[[], float]) -> None:
        self.costs, self.clock = costs, clock
        self._busy: dict[str, _Window] = {}
        self._serving: deque[tuple[float, float]] = deque()     # (time, CPU seconds) of the serving path
        self._serving_total = 0.0

    def serving_work(self, tokens: int) -> None:
        """The serving path streamed `tokens` tokens just now."""
        cpu = tokens * self.costs.cpu_per_token_s
        if cpu > 0:
            self._serving.append((self.clock(), cpu))
            self._serving_total += cpu

    def factor(self, pod: str) -> float:
        """The wall/CPU factor of a step of `pod` starting now: one over its share of a core."""
        now, c = self.clock(), self.costs
        if c.cores <= 0:
            return 1.0
        since = now - c.window_s
        serving = self._serving
        while serving and serving[0][0] <= since:
            self._serving_total -= serving.popleft()[1]
        wants = [c.serving_cores + max(0.0, self._serving_total) / c.window_s]
        wants += [w.seconds(now, c.window_s) / c.window_s for name, w in self._busy.items() if name != pod]
        return 1.0 / fair_share(wants, c.cores)

    def stepped(self, pod: str, start: float, end: float) -> None:
        """`pod` is in a step from `start` to `end`: it wants a core meanwhile."""
        if self.costs.cores > 0:
            self._busy.setdefault(pod, _Window()).add(start, end)
