"""The goodput sweep's setup: configurations, prefix caching per mix, quick mode, plot output."""

from __future__ import annotations

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
