"""bench/kv_groups.py runs end to end and the groups hold less KV than one group, by the window."""

from __future__ import annotations

from bench.kv_groups import main


def test_kv_groups_bench_holds_less_with_a_table_per_group(capsys):
    main(["--shapes", "gpt-oss-20b", "--contexts", "2048", "--turn", "256", "--answer", "256"])
    row = capsys.readouterr().out.splitlines()[-1].split()
    one, grouped = float(row[2]), float(row[3])
    # 2048 tokens x 24 layers x 8 heads x 64 x 2 (K, V) x 2 bytes = 96 MiB; the 12 sliding layers
    # (window 128) then hold a window and a chunk: a little over half of it.
    assert one == 96.0 and 48.0 < grouped < 0.6 * one
