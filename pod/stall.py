"""Engine stall detection: a pod whose engine thread is stuck reports not ready until it recovers.

A SIGSTOPped pod answers nothing, and keepalive ends its connections; a pod whose engine thread
hangs (a stuck device, a hung kernel, a deadlock) still answers every RPC from its event loop, so
only the pod itself can tell. The engine thread goes round its loop at least every 50 ms when
idle and once per step when busy (`EngineLoop.last_iteration_at`); a pod whose thread has not done
so for longer than the threshold is stalled: its gRPC health says NOT_SERVING (the readiness
probe of the chart and of `cbserve up` fails, and the router takes it out of routing), the
requests it holds fail with UNAVAILABLE (the router retries them on other pods; decode pods pulling
from a stalled prefill pod prefill locally), and it says SERVING again once the thread moves. A stalled pod with nothing to do cannot exist: an idle
engine thread only waits 50 ms for commands.

The threshold is `--stall-seconds` (default 10 s), raised to `STALL_STEP_FACTOR` times the
longest recent step, so a model whose steps legitimately take seconds never flaps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

DEFAULT_STALL_SECONDS = 10.0
STALL_STEP_FACTOR = 10.0
CHECK_INTERVAL_SECONDS = 0.5


def stall_threshold(stall_seconds: float, recent_step_seconds: Iterable[float]) -> float:
    """Seconds without an engine-loop iteration after which the engine counts as stalled."""
    return max(stall_seconds, STALL_STEP_FACTOR * max(recent_step_seconds, default=0.0))


async def watch_engine(last_iteration_at: Callable[[], float], threshold: Callable[[], float],
                       on_change: Callable[[bool], None], interval: float = CHECK_INTERVAL_SECONDS) -> None:
    """Forever: call `on_change(stalled)` whenever the engine thread becomes stalled or recovers."""
    stalled = False
    while True:
        await asyncio.sleep(interval)
        silent = time.monotonic() - last_iteration_at()
        limit = threshold()
        now_stalled = silent > limit
        if now_stalled != stalled:
            stalled = now_stalled
            if stalled:
                log.warning("engine made no step for %.1fs (limit %.1fs): reporting NOT_SERVING", silent, limit)
            else:
                log.warning("engine moving again: reporting SERVING")
            on_change(stalled)
