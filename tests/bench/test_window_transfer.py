"""bench/window_transfer.py runs end to end on a tiny cache and moves only the window's blocks."""

from __future__ import annotations

from bench.window_transfer import main


def test_window_transfer_bench_moves_only_the_window(capsys):
    main(["--prompts", "160", "--window", "40", "--shape", "tiny", "--repeats", "1", "--skip-gloo"])
    rows = {r[1]: int(r[2]) for r in (line.split() for line in capsys.readouterr().out.splitlines())
            if len(r) == 6 and r[1] in ("all", "window")}
    # 160 tokens in 10 blocks of 16; the first decode query (at 160) sees keys 121..160: blocks 7..9.
    assert rows == {"all": 10, "window": 3}
