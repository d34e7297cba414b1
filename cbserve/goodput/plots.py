"""Goodput and SLO attainment against offered rate, one line per configuration (matplotlib, PNG)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_mix(rows: Sequence[dict], *, model: str, mix: str, slo_ttft_ms: float, slo_tpot_ms: float,
             path: Path) -> Path:
    """`rows`: summaries of one mix with keys config, offered_rps, goodput_rps, slo_attainment."""
    import matplotlib

    matplotlib.use("Agg")   # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax_goodput, ax_attain) = plt.subplots(1, 2, figsize=(11, 4.2))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    for config in configs:
        mine = sorted((r for r in rows if r["config"] == config), key=lambda r: r["offered_rps"])
        offered = [r["offered_rps"] for r in mine]
        ax_goodput.plot(offered, [r["goodput_rps"] for r in mine], marker="o", label=config)
        ax_attain.plot(offered, [100 * r["slo_attainment"] for r in mine], marker="o", label=config)
    if rows:
        top = max(r["offered_rps"] for r in rows)
        ax_goodput.plot([0, top], [0, top], color="0.8", linestyle=":", label="offered (ideal)")
    ax_goodput.set(xlabel="offered load (req/s)", ylabel="goodput (req/s meeting the SLO)", title="Goodput")
    ax_attain.set(xlabel="offered load (req/s)", ylabel="SLO attainment (%)", ylim=(-2, 102), title="SLO attainment")
    ax_attain.axhline(90, color="0.7", linestyle="--", linewidth=1)
    for ax in (ax_goodput, ax_attain):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"cbserve, model {model}, mix {mix}: SLO per request TTFT <= {slo_ttft_ms:g} ms, "
                 f"TPOT <= {slo_tpot_ms:g} ms")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
