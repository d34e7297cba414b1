"""The goodput benchmark's text output: one table row per mix/config/rate, and goodput ratios.

Two summary figures per configuration and mix:
- peak goodput: the most SLO-meeting requests per second it delivered at any offered rate;
- SLO-rate: the highest offered rate it served with >= 90% SLO attainment (DistServe's goodput).
Ratios compare the baseline configuration (1 prefill + 1 decode, goodput policy) with each other one.
"""

from __future__ import annotations

from collections.abc import Sequence

ATTAINMENT_TARGET = 0.9
_COLUMNS = [  # header, row key, width, decimals (None: text), scale
    ("config", "config", 15, None, 1.0),
    ("rate", "rate", 5, 2, 1.0),
    ("offered", "offered_rps", 7, 2, 1.0),
    ("done/s", "completed_rps", 6, 2, 1.0),
    ("goodput", "goodput_rps", 7, 2, 1.0),
    ("attain%", "slo_attainment", 7, 1, 100.0),
    ("ttft50ms", "p50_ttft_s", 8, 0, 1000.0),
    ("ttft95ms", "p95_ttft_s", 8, 0, 1000.0),
    ("tpot95ms", "p95_tpot_s", 8, 1, 1000.0),
    ("e2e95ms", "p95_e2e_s", 8, 0, 1000.0),
    ("queue95ms", "p95_router_queue_s", 9, 0, 1000.0),
    ("err%", "error_rate", 5, 1, 100.0),
    ("preempt", "preemptions", 7, 0, 1.0),
    ("n", "num_requests", 5, 0, 1.0),
]


def _cell(value, width: int, decimals: int | None, scale: float) -> str:
    if decimals is None:
        return f"{value:<{width}}"
    if value is None:
        return "-".rjust(width)
    return f"{value * scale:>{width}.{decimals}f}"


def format_table(rows: Sequence[dict], header: bool = True) -> str:
    """Fixed-width text rows (and the header line when `header`); None shows as `-`."""
    lines = []
    if header:
        lines.append(" ".join(f"{name:<{w}}" if d is None else f"{name:>{w}}" for name, _, w, d, _ in _COLUMNS))
    for row in rows:
        lines.append(" ".join(_cell(row.get(key), w, d, scale) for _, key, w, d, scale in _COLUMNS))
    return "\n".join(lines)


def median_runs(rows: Sequence[dict]) -> list[dict]:
    """Per (mix, config, rate), in first-seen order, the run with the median goodput (the lower
    middle one of an even count): `bench/goodput.py --repeats`' summary row, a run that happened."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["mix"], r["config"], r["rate"]), []).append(r)
    return [sorted(runs, key=lambda r: r["goodput_rps"])[(len(runs) - 1) // 2] for runs in groups.values()]


def slo_rate(rows: Sequence[dict]) -> float:
    """Highest offered rate served with >= 90% attainment (0 when none was)."""
    return max((r["offered_rps"] for r in rows if r["slo_attainment"] >= ATTAINMENT_TARGET), default=0.0)


def goodput_ratios(rows: Sequence[dict], baseline: str) -> dict[str, dict]:
    """{mix: {"configs": {config: {peak_goodput_rps, slo_rate_rps}}, "ratios": {other: {...}}}}."""
    out: dict[str, dict] = {}
    for mix in dict.fromkeys(r["mix"] for r in rows):
        configs = {}
        for config in dict.fromkeys(r["config"] for r in rows if r["mix"] == mix):
            mine = [r for r in rows if r["mix"] == mix and r["config"] == config]
            configs[config] = {"peak_goodput_rps": max(r["goodput_rps"] for r in mine), "slo_rate_rps": slo_rate(mine)}
        ratios = {}
        if baseline in configs:
            base = configs[baseline]
            for other, figures in configs.items():
                if other != baseline:
                    ratios[other] = {key: (base[key] / figures[key] if figures[key] > 0 else None)
                                     for key in ("peak_goodput_rps", "slo_rate_rps")}
        out[mix] = {"configs": configs, "ratios": ratios, "baseline": baseline}
    return out


def print_ratios(ratios: dict[str, dict]) -> None:
    for mix, entry in ratios.items():
        print(f"\n## {mix}: peak goodput (req/s) and highest rate with >= {ATTAINMENT_TARGET:.0%} attainment")
        for config, figures in entry["configs"].items():
            print(f"  {config:<15} peak goodput {figures['peak_goodput_rps']:6.2f}   "
                  f"SLO rate {figures['slo_rate_rps']:6.2f}")
        for other, r in entry["ratios"].items():
            fmt = lambda v: "n/a (other is 0)" if v is None else f"{v:.2f}x"  # noqa: E731
            print(f"  {entry['baseline']} / {other}: peak goodput {fmt(r['peak_goodput_rps'])}, "
                  f"SLO rate {fmt(r['slo_rate_rps'])}")
