"""`cbserve profile --resume`: stage A stopped anywhere goes on from its journal (real tiny engine, a tiny grid)."""

from __future__ import annotations

import json

import pytest

from cbserve.cli import main
from cbserve.planner.step_grid import StepGrid

GRID = ["profile", "--model", "tiny", "--no-in-situ", "--passes", "2", "--repeats", "1", "--held-out-points", "2",
        "--max-batch", "2", "--max-context", "96", "--max-held-out-error", "100"]


class Stopped(BaseException):
    """A run stopped from outside (a lock's time limit) in the middle of a point."""


def test_a_stopped_grid_resumes_where_it_was_and_refuses_another_profiles_journal(monkeypatch, tmp_path, capsys):
    journal, out = tmp_path / "grid.journal", tmp_path / "p.json"
    measured = []
    real = StepGrid.measure

    def counting(self, point, stop_after=None):
        if stop_after is not None and len(measured) >= stop_after:
            raise Stopped
        measured.append(str(point))
        return real(self, point)

    monkeypatch.setattr(StepGrid, "measure", lambda self, point: counting(self, point, stop_after=7))
    with pytest.raises(Stopped):
        main(GRID + ["--resume", str(journal), "--out", str(out)])
    assert not out.exists()
    lines = journal.read_text().splitlines()
    assert json.loads(lines[0])["format"] == "cbserve-profile-journal" and len(lines) == 1 + 7
    first = list(measured)

    monkeypatch.setattr(StepGrid, "measure", lambda self, point: counting(self, point))
    assert main(GRID + ["--resume", str(journal), "--out", str(out)]) == 0
    total = len(journal.read_text().splitlines()) - 1
    assert len(measured) == total and total > 7          # the rest measured once, nothing twice
    points = json.loads(out.read_text())
    assert len(points["grid"]) + len(points["held_out_points"]) == total // 2
    assert all(len(m["seconds"]) == 2 for m in points["grid"])   # both passes' samples, every point
    assert "7 grid points already measured" in capsys.readouterr().err
    assert measured[:7] == first

    # A third run measures nothing and writes the same stage A; other grid flags are refused.
    measured.clear()
    again = tmp_path / "q.json"
    assert main(GRID + ["--resume", str(journal), "--out", str(again)]) == 0
    assert not measured and json.loads(again.read_text())["grid"] == points["grid"]
    assert main(GRID + ["--max-context", "128", "--resume", str(journal), "--out", str(again)]) == 2
    assert "measured for another profile (differs in points, settings)" in capsys.readouterr().err
    assert main(GRID + ["--resume", str(journal), "--grid-from", str(out), "--out", str(again)]) == 2
