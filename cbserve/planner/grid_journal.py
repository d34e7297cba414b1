"""Stage A across sittings: every measured grid point kept in a file, so a stopped run goes on.

On a shared machine a measurement holds a lock for a few minutes at a time; a larger model's grid
(`small`: over 4 minutes a pass) does not fit one hold. `cbserve profile --resume FILE` appends
each point's samples to FILE (JSON lines, flushed per point) as soon as they are measured, and a
later run with the same model, engine flags and grid settings skips every (pass, point) the file
holds. A run stopped anywhere (the lock's time limit, a signal) loses at most the point it was
in. Each pass keeps its own random order (seeded by the pass), so a resumed profile measures the
same points in the same order as one that ran in one go; only the minutes differ, which the
least-sample cost already tolerates. More `--passes` on a later run add passes to a journal.

    {"format": "cbserve-profile-journal", "version": 1, "identity": {...}}      # the first line
    {"pass": 0, "index": 17, "shape": {...}, "seconds": [...], "point_s": 1.9}  # one per point
"""

from __future__ import annotations

import json
from pathlib import Path

from cbserve.planner.step_grid import GridPoint, Measurement
from engine.telemetry.step_shape import StepShape

FORMAT = "cbserve-profile-journal"
VERSION = 1


class JournalError(ValueError):
    """A journal that belongs to another profile (model, flags, grid) or cannot be read."""


class GridJournal:
    """The grid points measured so far by (pass, index); `record` appends one."""

    def __init__(self, path: str | Path, identity: dict) -> None:
        self.path = Path(path)
        self.done: dict[tuple[int, int], dict] = {}
        if self.path.exists() and self.path.stat().st_size:
            self._load(identity)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"format": FORMAT, "version": VERSION, "identity": identity}) + "\n")

    def _load(self, identity: dict) -> None:
        lines = self.path.read_text().splitlines()
        try:
            header = json.loads(lines[0])
        except (json.JSONDecodeError, IndexError):
            raise JournalError(f"{self.path}: not a profile journal") from None
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise JournalError(f"{self.path}: not a version-{VERSION} profile journal")
        theirs = header.get("identity", {})
        differ = sorted(k for k in identity.keys() | theirs.keys() if identity.get(k) != theirs.get(k))
        if differ:
            raise JournalError(f"{self.path}: measured for another profile (differs in {', '.join(differ)}); "
                               "use a new file or the same flags")
        for n, line in enumerate(lines[1:], start=2):
            try:
                entry = json.loads(line)
                self.done[(int(entry["pass"]), int(entry["index"]))] = entry
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                if n == len(lines):     # the point a stopped run was writing: measured again
                    continue
                raise JournalError(f"{self.path}, line {n}: not a measured grid point") from None

    def get(self, round_: int, index: int, point: GridPoint) -> Measurement | None:
        entry = self.done.get((round_, index))
        if entry is None:
            return None
        return Measurement(point, StepShape.from_json(entry["shape"]), tuple(entry["seconds"]))

    def record(self, round_: int, index: int, m: Measurement, point_s: float) -> None:
        entry = {"pass": round_, "index": index, "shape": m.shape.to_json(), "seconds": list(m.seconds),
                 "point_s": point_s}
        self.done[(round_, index)] = entry
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()

    @property
    def seconds(self) -> float:
        """Time spent measuring the points it holds, over every sitting."""
        return sum(float(e.get("point_s", 0.0)) for e in self.done.values())
