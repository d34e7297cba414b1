"""Progress bars for the operations a person waits on: generating and loading weights, profiling
the KV cache, capturing CUDA graphs, and benchmark runs.

Why quiet off a terminal: pods, CI and pipes read stderr as a log, where carriage-return redraws
are noise; the logs already say what finished and how long it took. So a bar draws only when the
stream it writes to is a terminal, and costs one attribute check per update otherwise.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import IO, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def on_terminal(stream: IO[str] | None = None) -> bool:
    """True when `stream` (default stderr) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def progress(iterable: Iterable[T] | None = None, *, desc: str, total: int | None = None, unit: str = "it",
             leave: bool = False, stream: IO[str] | None = None, quiet: bool = False) -> tqdm:
    """A tqdm bar over `iterable` (or one to `update()` by hand) that draws only on a terminal
    (and never when `quiet`).

    `leave=False` (the default) erases the bar when it ends, so a finished step leaves only its
    log line behind; benchmarks that report per-run results pass `leave=True`."""
    stream = sys.stderr if stream is None else stream
    return tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave, file=stream,
                disable=quiet or not on_terminal(stream), dynamic_ncols=True, mininterval=0.25)


@contextmanager
def stage(desc: str, stream: IO[str] | None = None) -> Iterator[None]:
    """One long step with no natural count (a profiling forward): a 0/1 bar with the elapsed time
    while it runs."""
    bar = progress(desc=desc, total=1, unit="step", stream=stream)
    try:
        yield
        bar.update(1)
    finally:
        bar.close()
