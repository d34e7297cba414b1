"""`cbserve plan --search`: the highest rate each configuration sustains, and which one to run.

A rate is sustained when the simulated run's SLO attainment (requests meeting both SLOs over
those not cancelled: `bench/stats.py`'s) is at least the target and the chosen percentile of TTFT
and of TPOT is inside its SLO (`Criterion`). Capacity is found by doubling or halving from a
starting guess until the rate is bracketed, then bisecting (geometric midpoints) until the bracket
is within `tolerance`; capacity is the bracket's sustained end.

The prediction's uncertainty is a band around each finalist's capacity: the capacity found again
with every step `1 + u` and `1 - u` times as long, where u is the profile's held-out step error
plus the in-situ calibration's relative residual. `recommend` picks the configuration:
- per pod (one device each), by capacity per pod, unless a target rate is given; then the fewest
  pods whose capacity reaches it;
- disaggregated only when its band lies wholly above the best colocated one's: it beats colocated
  by more than the prediction's uncertainty. Otherwise colocated, and the reason says why.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from cbserve.goodput.stats import Slo, percentile

# `cbserve plan --search`'s configurations when --configs names none.
SEARCH_CONFIGS = ("colocated-1", "colocated-2", "colocated-3", "colocated-4", "1P1D", "1P2D", "2P1D", "2P2D")


@dataclass(frozen=True)
class Criterion:
    slo: Slo
    attainment: float = 0.9
    percentile: float = 90.0

    def sustained(self, row: dict, results) -> bool:
        if row["slo_attainment"] < self.attainment:
            return False
        ok = [r for r in results if r.outcome == "ok"]
        ttft = percentile([r.ttft_s for r in ok if r.ttft_s is not None], self.percentile)
        tpot = percentile([r.tpot_s for r in ok if r.tpot_s is not None], self.percentile)
        return ttft is not None and ttft <= self.slo.ttft_s and (tpot is None or tpot <= self.slo.tpot_s)


@dataclass
class Probe:
    rate: float
    row: dict
    sustained: bool
    load: dict = field(default_factory=dict)


@dataclass
class Capacity:
    """A configuration's search: its capacity (0 when not even the lowest rate was sustained)."""

    config: str
    pods: int
    disaggregated: bool
    capacity_rps: float = 0.0
    probes: list[Probe] = field(default_factory=list)
    low_rps: float | None = None       # the uncertainty band (finalists only)
    high_rps: float | None = None

    @property
    def per_pod(self) -> float:
        return self.capacity_rps / self.pods

    @property
    def band(self) -> tuple[float, float]:
        return (self.capacity_rps if self.low_rps is None else self.low_rps,
                self.capacity_rps if self.high_rps is None else self.high_rps)

    @property
    def at_capacity(self) -> Probe | None:
        sustained = [p for p in self.probes if p.sustained and p.rate == self.capacity_rps]
        return sustained[-1] if sustained else None


def find_capacity(evaluate: Callable[[float], Probe], start: float, tolerance: float = 0.05,
                  min_rate: float = 0.01, max_rate: float = 10_000.0, max_probes: int = 24) -> tuple[float, list[Probe]]:
    """(capacity, probes in the order run) of a monotone `evaluate(rate).sustained`."""
    probes: list[Probe] = []

    def probe(rate: float) -> bool:
        result = evaluate(rate)
        probes.append(result)
        return result.sustained

    lo, hi = 0.0, math.inf
    rate = min(max(start, min_rate), max_rate)
    while len(probes) < max_probes:
        if probe(rate):
            lo = rate
            if rate >= max_rate:
                return rate, probes
            rate = min(rate * 2, max_rate) if hi == math.inf else rate
        else:
            hi = rate
            if rate <= min_rate:
                return 0.0, probes
            rate = max(rate / 2, min_rate) if lo == 0.0 else rate
        if lo and hi < math.inf:
            break
    while lo and hi < math.inf and hi / lo > 1 + tolerance and len(probes) < max_probes:
        mid = math.sqrt(lo * hi)
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


@dataclass(frozen=True)
class Recommendation:
    config: str
    reason: str


def _best(candidates: list[Capacity]) -> Capacity | None:
    return max(candidates, key=lambda c: (c.per_pod, -c.pods), default=None)


def _per_pod_band(c: Capacity) -> tuple[float, float]:
    low, high = c.band
    return low / c.pods, high / c.pods


def recommend(candidates: list[Capacity], target_rate: float | None = None) -> Recommendation:
    """The configuration to deploy (see the module docstring); raises ValueError without candidates."""
    if not candidates:
        raise ValueError("no configuration to recommend")
    if target_rate is not None:
        feasible = [c for c in candidates if c.capacity_rps >= target_rate]
        if not feasible:
            best = max(candidates, key=lambda c: c.capacity_rps)
            return Recommendation(best.config, f"no configuration reaches {target_rate:g} req/s; {best.config} "
                                               f"comes closest ({best.capacity_rps:.2f} req/s): add pods")
        fewest = min(c.pods for c in feasible)
        candidates = [c for c in feasible if c.pods == fewest]
    colocated = _best([c for c in candidates if not c.disaggregated])
    disaggregated = _best([c for c in candidates if c.disaggregated])
    if colocated is None or colocated.capacity_rps == 0:
        if disaggregated is not None and disaggregated.capacity_rps > 0:
            return Recommendation(disaggregated.config, "only disaggregated configurations sustain the SLO")
        best = colocated or disaggregated
        return Recommendation(best.config, "no configuration sustains the SLO at any rate tried")
    if disaggregated is None or disaggregated.capacity_rps == 0:
        return Recommendation(colocated.config, "colocated: no disaggregated configuration sustains the SLO"
                              if disaggregated is not None else "colocated: no disaggregated configuration was given")
    d_low, d_high = _per_pod_band(disaggregated)
    c_low, c_high = _per_pod_band(colocated)
    gain = disaggregated.per_pod / colocated.per_pod - 1
    if d_low > c_high:
        return Recommendation(disaggregated.config,
                              f"disaggregated: {disaggregated.config} holds {gain:+.0%} per pod over {colocated.config}, "
                              f"beyond the prediction's uncertainty ({d_low:.2f}-{d_high:.2f} vs "
                              f"{c_low:.2f}-{c_high:.2f} req/s per pod)")
    if gain > 0:
        return Recommendation(colocated.config,
                              f"colocated: {disaggregated.config} is {gain:+.0%} per pod, inside the prediction's "
                              f"uncertainty ({d_low:.2f}-{d_high:.2f} vs {c_low:.2f}-{c_high:.2f} req/s per pod)")
    if gain > -0.005:
        return Recommendation(colocated.config, f"colocated: {colocated.config} holds as much per pod as "
                                                f"{disaggregated.config}")
    return Recommendation(colocated.config, f"colocated: {colocated.config} holds {-gain:.0%} more per pod than "
                                            f"{disaggregated.config}")
