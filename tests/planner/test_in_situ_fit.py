"""Stage B's fit recovers a serving path it did not see: probes played on a simulated cluster with
known overheads, contention and KV bandwidth, then fitted as if they had been measured."""

from __future__ import annotations

import pytest

from cbserve.planner.in_situ import _fit_probes, _serving_from_probes, probe_requests
from cbserve.planner.profile import ServingProfile, with_serving
from cbserve.planner.in_situ import _simulate

TRUTH = ServingProfile(contention=2.0, prefill_contention=2.0, http_in_s=0.003, rpc_s=0.002, token_out_s=0.005,
                       kv_message_s=0.004, kv_bytes_per_s=40e6)


def test_probes_recover_path_contention_and_kv_bandwidth(profile):
    probes = probe_requests(profile, repeats=2, seed=0)
    measured, _ = _simulate(with_serving(profile, TRUTH), probes)
    assert all(r.outcome == "ok" for r in measured)
    fit = _fit_probes(profile, probes, measured)
    assert fit["prefill_contention_alone"] == pytest.approx(2.0, rel=0.05)
    assert fit["decode_contention_alone"] == pytest.approx(2.0, rel=0.1)
    assert fit["ttft_overhead_s"] == pytest.approx(0.010, abs=0.002)
    serving = _serving_from_probes(fit, profile.engine["kv_bytes_per_token"])
    assert serving.kv_bytes_per_s == pytest.approx(40e6, rel=0.2)
    assert serving.kv_message_s == pytest.approx(0.004, abs=0.003)
    assert serving.http_in_s + serving.rpc_s + serving.token_out_s == pytest.approx(0.010, abs=0.002)


def test_probes_run_one_at_a_time(profile):
    probes = probe_requests(profile, repeats=3, seed=1)
    assert len(probes) == 18 and {p.max_tokens for p in probes} == {2, 24}
    measured, _ = _simulate(with_serving(profile, TRUTH), probes)
    spans = sorted((r.sent_s, r.done_s) for r in measured)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))     # no overlap: each alone on the cluster
