"""bench/window_decode.py runs end to end on the tiny preset and reports the blocks a window frees."""

from __future__ import annotations

from bench.window_decode import main


def test_window_decode_bench_runs_and_counts_freed_blocks(capsys):
    main(["--model", "tiny", "--decode", "1,2", "--context", "96", "--window", "20", "--iters", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("full", "gemma3", "all"))]
    held = {(r[0], r[-5]): int(r[-4]) for r in rows}
    # 96 tokens in 6 blocks of 16; the query at 95 sees keys 76..95: blocks 4 and 5 only.
    assert held[("full", "1x96")] == 6 and held[("gemma3", "1x96")] == 6 and held[("all", "1x96")] == 2
