"""bench/host_step.py's measurement runs: a decode batch through the engine with an instant model,
on the padded bucket path (no timings asserted)."""

from __future__ import annotations

import argparse

import pytest

from bench import host_step


@pytest.mark.parametrize("churn", [0, 2])
def test_one_measurement_runs_a_decode_batch(churn):
    """0: the same batch throughout; 2: a request ends and one arrives every 2 steps."""
    args = argparse.Namespace(warmup=2, steps=5, model="tiny", temperature=0.0, top_p=1.0, detokenize=False,
                              churn=churn)
    result = host_step.measure(args, 3)
    assert result["batch"] == 3 and result["steps"] == 5
    assert 0 < result["p10_us"] <= result["median_us"] <= result["p90_us"] and result["cpu_us"] > 0
    assert result["p10_us"] <= result["mean_us"]


def test_the_table_puts_trees_side_by_side():
    rows = {"base": {1: [dict(median_us=500, mean_us=550, p10_us=400, p90_us=700, cpu_us=480)]},
            "new": {1: [dict(median_us=200, mean_us=220, p10_us=150, p90_us=260, cpu_us=190)]}}
    table = host_step.table(rows, [1])
    assert "| 1 | 500, 400 / 700 (480) | 200, 150 / 260 (190) | x0.40 |" in table
    assert "| 1 | 550 | 220 | x0.40 |" in host_step.mean_table(rows, [1])
