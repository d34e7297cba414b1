"""Benchmark statistics: percentiles, goodput/attainment accounting, Prometheus histogram quantiles."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cbserve.goodput import prom
from cbserve.goodput.stats import RequestResult
from cbserve.goodput.report import goodput_ratios
from cbserve.goodput.stats import Slo, percentile, summarize


@pytest.mark.parametrize("q", [0, 5, 50, 90, 95, 99, 100])
def test_percentile_matches_numpy_linear(q):
    values = [random.Random(i).random() for i in range(57)]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([4.0], 95) == 4.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def result(outcome="ok", ttft=0.1, tpot=0.02, tokens=11, sent=1.0) -> RequestResult:
    first = sent + ttft
    last = first + tpot * (tokens - 1)
    return RequestResult(0, sent, sent_s=sent, outcome=outcome, first_token_s=first, last_token_s=last,
                         done_s=last + 0.001, num_output_tokens=tokens)


def test_goodput_accounting():
    slo = Slo(ttft_s=0.5, tpot_s=0.05)
    results = [
        result(),                                   # meets both
        result(ttft=0.2, tpot=0.049),               # meets both
        result(tokens=1),                           # one token: no TPOT, meets
        result(ttft=0.6),                           # misses TTFT
        result(tpot=0.06),                          # misses TPOT
        result(outcome="cancelled", tokens=3),      # not counted for or against
        result(outcome="rejected"),                 # failed
        result(outcome="timeout"),                  # failed
    ]
    s = summarize(results, rate=1.0, duration_s=8.0, elapsed_s=10.0, slo=slo, p95_router_queue_s=0.01,
                  preemptions=2)
    assert (s.num_requests, s.num_ok, s.num_cancelled, s.num_rejected, s.num_timeouts) == (8, 5, 1, 1, 1)
    assert s.offered_rps == pytest.approx(1.0)
    assert s.completed_rps == pytest.approx(0.5)
    assert s.goodput_rps == pytest.approx(0.3)
    assert s.slo_attainment == pytest.approx(3 / 7)
    assert s.error_rate == pytest.approx(2 / 7)
    assert s.p95_tpot_s == pytest.approx(percentile([0.02, 0.049, 0.02, 0.06], 95))
    assert s.p50_ttft_s == pytest.approx(0.1)
    assert s.preemptions == 2 and s.p95_router_queue_s == 0.01


def test_histogram_quantile_like_prometheus():
    text = "\n".join([
        "# TYPE lat histogram",
        'lat_bucket{phase="router_queue",le="0.1"} 50',
        'lat_bucket{phase="router_queue",le="0.2"} 90',
        'lat_bucket{phase="router_queue",le="0.5"} 100',
        'lat_bucket{phase="router_queue",le="+Inf"} 100',
        'lat_count{phase="router_queue"} 100',
        'lat_sum{phase="router_queue"} 12',
        'lat_bucket{phase="prefill",le="0.1"} 0',
        'lat_bucket{phase="prefill",le="+Inf"} 7',
        "",
    ])
    samples = prom.parse(text)
    assert prom.histogram_quantile(0.5, samples, "lat", phase="router_queue") == pytest.approx(0.1)
    assert prom.histogram_quantile(0.7, samples, "lat", phase="router_queue") == pytest.approx(0.15)
    assert prom.histogram_quantile(0.95, samples, "lat", phase="router_queue") == pytest.approx(0.35)
    # All observations beyond the last finite bound: the bound is all a histogram knows.
    assert prom.histogram_quantile(0.5, samples, "lat", phase="prefill") == pytest.approx(0.1)
    assert prom.histogram_quantile(0.5, samples, "lat", phase="decode") is None
    before = prom.parse(text.replace(" 100\n", " 60\n"))
    assert prom.total(prom.delta(samples, before), "lat_count") == 40


def test_goodput_ratios():
    rows = [{"mix": "chat", "config": c, "offered_rps": rate, "goodput_rps": g, "slo_attainment": a}
            for c, rate, g, a in [("pd-goodput", 1, 1.0, 1.0), ("pd-goodput", 2, 1.9, 0.95), ("pd-goodput", 4, 2.0, 0.5),
                                  ("colocated-2", 1, 1.0, 0.95), ("colocated-2", 2, 1.0, 0.5)]]
    out = goodput_ratios(rows, baseline="pd-goodput")["chat"]
    assert out["configs"]["pd-goodput"] == {"peak_goodput_rps": 2.0, "slo_rate_rps": 2}
    assert out["ratios"]["colocated-2"] == {"peak_goodput_rps": 2.0, "slo_rate_rps": 2.0}
