"""Reading Prometheus `/metrics` pages: scrape, difference two scrapes, histogram quantiles.

The benchmark scrapes the router and every pod before and after each run; the difference of the two
scrapes is what that run did (counters and histogram buckets only grow while the processes live).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

# A sample's key: (sample name, sorted label pairs).
SampleKey = tuple[str, tuple[tuple[str, str], ...]]
Samples = dict[SampleKey, float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """One `/metrics` page as samples; empty when the endpoint does not answer."""
    try:
        response = httpx.get(url, timeout=timeout, trust_env=False)
        response.raise_for_status()
    except httpx.HTTPError:
        return {}
    return parse(response.text)


def delta(after: Samples, before: Samples) -> Samples:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    return sum(v for (n, lbls), v in samples.items() if n == name and set(labels.items()) <= set(lbls))


def histogram_quantile(q: float, samples: Samples, name: str, **labels: str) -> float | None:
    """Prometheus' `histogram_quantile(q, ...)` over the `<name>_bucket` samples matching `labels`:
    linear interpolation inside the bucket that holds the q-th observation; None without observations."""
    buckets: dict[float, float] = {}
    for (n, lbls), value in samples.items():
        label_map = dict(lbls)
        if n != f"{name}_bucket" or any(label_map.get(k) != v for k, v in labels.items()):
            continue
        bound = float(label_map["le"])
        buckets[bound] = buckets.get(bound, 0.0) + value      # summed across label sets (e.g. pods)
    return quantile_from_buckets(q, buckets.items())


def quantile_from_buckets(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """`buckets`: (upper bound, cumulative count) pairs, +Inf included."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound     # beyond the last finite bucket: its bound is all we know
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return ordered[-1][0]


def mean_by_label(samples: Samples, name: str, label: str = "role") -> dict[str, float]:
    """Mean observation of histogram `name` (`_sum` / `_count`) per value of `label`."""
    sums: dict[str, list[float]] = {}
    for (sample, labels), value in samples.items():
        for suffix, i in (("_sum", 0), ("_count", 1)):
            if sample == name + suffix:
                key = dict(labels).get(label, "")
                sums.setdefault(key, [0.0, 0.0])[i] += value
    return {key: s / c for key, (s, c) in sums.items() if c > 0}


def latency_calibration(samples: Samples) -> dict[str, list[float]]:
    """The router's goodput-policy calibration factors at the scrape (`cbserve_router_latency_calibration`,
    one per pod and SLO: the quantile of observed over predicted latency its gate multiplies a
    prediction by), sorted per SLO ("ttft", "tpot"); pods that have none yet are left out. A
    measured run and a simulated one report the same, so a row says how pessimistic each router's
    gate was at its end."""
    out: dict[str, list[float]] = {}
    for (name, labels), value in samples.items():
        if name == "cbserve_router_latency_calibration":
            out.setdefault(dict(labels).get("slo", ""), []).append(value)
    return {slo: sorted(values) for slo, values in sorted(out.items())}
