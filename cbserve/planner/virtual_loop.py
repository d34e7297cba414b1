"""An asyncio event loop on virtual time: waiting costs nothing, the clock jumps to the next timer.

The planner runs the router's real asyncio code (admission's futures, `wait_for` deadlines,
`call_soon` passes) and its simulated pods as coroutines on this loop. `time()` is a virtual clock
that starts at 0; when no callback is ready, the selector, instead of sleeping until the next timer,
moves the clock to it. So `await asyncio.sleep(d)` takes d seconds of virtual time and none of
wall time, and everything on the loop sees one consistent clock. Timers due at the same instant
run in the order they were set (asyncio's own heap leaves ties in any order), so a simulation is
reproducible to the step (pass `loop.time` wherever the
production code reads `time.monotonic`). Nothing may do real I/O on it: the selector has no file
descriptors to watch, and a loop with nothing scheduled and nothing ready has deadlocked (an
error, rather than waiting forever).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Deadlock(RuntimeError):
    """Every coroutine waits and no timer is set: the simulation can never make progress."""


class _VirtualSelector(selectors.BaseSelector):
    """Registers the loop's self-pipe and never reports it; `select(timeout)` advances the clock."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop
        self._map: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj, events, data=None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(),
                                    events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list:
        if timeout is None:
            raise Deadlock("the simulation deadlocked: every task waits and no timer is set")
        self._loop.advance(timeout)
        return []

    def get_map(self):
        return self._map

    def close(self) -> None:
        self._map.clear()


class _OrderedTimer(asyncio.TimerHandle):
    """A timer that sorts after the timers set before it for the same instant."""

    __slots__ = ("_seq",)

    def __lt__(self, other) -> bool:
        return (self._when, self._seq) < (other._when, other._seq)

    def __le__(self, other) -> bool:
        return (self._when, self._seq) <= (other._when, other._seq)

    def __gt__(self, other) -> bool:
        return (self._when, self._seq) > (other._when, other._seq)

    def __ge__(self, other) -> bool:
        return (self._when, self._seq) >= (other._when, other._seq)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose `time()` is virtual (see the module docstring)."""

    def __init__(self) -> None:
        self._now = 0.0
        self._timer_seq = itertools.count()
        super().__init__(_VirtualSelector(self))

    def call_at(self, when, callback, *args, context=None) -> asyncio.TimerHandle:
        self._check_closed()
        timer = _OrderedTimer(when, callback, args, self, context)
        timer._seq = next(self._timer_seq)
        heapq.heappush(self._scheduled, timer)
        timer._scheduled = True
        return timer

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self._now += seconds


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on a fresh virtual-time loop, then cancel what it left running (as
    `asyncio.run` does) and close the loop."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.close()
