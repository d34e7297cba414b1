"""The goodput sweep's setup: configurations, prefix caching per mix, quick mode, plot output."""

from __future__ import annotations

import json

import pytest

from bench.goodput import CONFIGS, cluster_spec, parse_args
from cbserve.goodput.plots import plot_mix
from cbserve.goodput.workloads import MIXES


def test_quick_mode_is_one_mix_two_rates_twenty_seconds():
    args = parse_args(["--quick"])
    assert (args.mixes, args.rates, args.duration) == (["chat"], [1.0, 4.0], 20.0)
    assert args.configs == list(CONFIGS)


def test_configs_share_cores_and_cache_only_shared_prefixes():
    args = parse_args(["--model", "small", "--slo-ttft-ms", "800"])
    pd = cluster_spec(args, "pd-round-robin", MIXES["chat"])
    assert (pd.num_prefill, pd.num_decode, pd.policy, pd.threads_per_pod) == (1, 1, "round_robin", 1)
    assert not pd.prefix_caching and pd.slo_ttft_ms == 800 and pd.model == "small" and pd.port == 0
    colocated = cluster_spec(args, "colocated-2", MIXES["shared-prefix"])
    assert (colocated.num_colocated, colocated.threads_per_pod, colocated.prefix_caching) == (2, 1, True)
    forced = cluster_spec(parse_args(["--prefix-caching", "on"]), "pd-goodput", MIXES["chat"])
    assert forced.prefix_caching


def test_plot_is_a_png(tmp_path):
    rows = [{"config": c, "offered_rps": r, "goodput_rps": r * g, "slo_attainment": g}
            for c, g in (("pd-goodput", 0.9), ("colocated-2", 0.5)) for r in (1.0, 2.0)]
    path = plot_mix(rows, model="tiny", mix="chat", slo_ttft_ms=500, slo_tpot_ms=50, path=tmp_path / "g.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_median_runs_keep_a_real_run_per_row():
    from cbserve.goodput.report import median_runs

    rows = [{"mix": "chat", "config": c, "rate": r, "goodput_rps": g, "repeat": i}
            for i, gs in enumerate(((3.0, 9.0), (1.0, 7.0), (2.0, 8.0), (4.0, 6.0))) for c, g, r in
            (("1P1D", gs[0], 2.0), ("colocated-2", gs[1], 2.0))]
    by_config = {r["config"]: r for r in median_runs(rows)}
    assert [r["config"] for r in median_runs(rows)] == ["1P1D", "colocated-2"]
    assert (by_config["1P1D"]["goodput_rps"], by_config["1P1D"]["repeat"]) == (2.0, 2)   # the lower middle of 4
    assert (by_config["colocated-2"]["goodput_rps"], by_config["colocated-2"]["repeat"]) == (7.0, 1)


def test_repeats_below_one_are_refused():
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])
    assert parse_args([]).repeats == 1


@pytest.mark.slow
def test_repeats_interleave_the_configurations_on_fresh_clusters(tmp_path, capsys):
    """Two real tiny clusters, two passes: every configuration's first pass, then every one's second."""
    from bench.goodput import main

    out = tmp_path / "run.json"
    assert main(["--model", "tiny", "--mixes", "fixed-256-64", "--configs", "colocated-1", "1P1D",
                 "--rates", "2", "--duration", "2", "--warmup", "1", "--repeats", "2", "--stop-below-attainment", "0",
                 # SLOs that admit everything: on a loaded machine the goodput gate may refuse a tiny run whole
                 "--slo-ttft-ms", "600000", "--slo-tpot-ms", "600000",
                 "--out-dir", str(tmp_path), "--json", str(out), "--log-dir", str(tmp_path / "logs")]) == 0
    data = json.loads(out.read_text())
    assert [(r["config"], r["repeat"]) for r in data["rows"]] == [
        ("colocated-1", 0), ("1P1D", 0), ("colocated-1", 1), ("1P1D", 1)]
    assert data["meta"]["repeats"] == 2 and all(r["num_requests"] == data["rows"][0]["num_requests"] > 0
                                                for r in data["rows"])    # the same requests each pass
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "fixed-256-64-1P1D", "fixed-256-64-1P1D-repeat1", "fixed-256-64-colocated-1", "fixed-256-64-colocated-1-repeat1"]
    assert "each row's median of 2 runs" in capsys.readouterr().out
    # Where a request's time went and how pessimistic the router's gate was, for plan_check to set beside
    # the simulated router's: every phase's median and p95; a calibration factor per pod and SLO.
    from router.metrics import PHASES

    pd = data["rows"][1]
    assert pd["num_ok"] == pd["num_requests"] and set(pd["phase_s"]) == set(PHASES) and pd["phase_s"]["prefill"]["50"] > 0
    assert set(pd["latency_calibration"]) == {"ttft", "tpot"} and all(
        len(v) == 1 and v[0] > 0 for v in pd["latency_calibration"].values())
