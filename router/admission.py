"""Admission control: admit now, wait in a bounded deadline-ordered queue, or refuse.

`try_route` is the caller's routing attempt; on success it has already reserved the chosen pods
(the router's in-flight accounting), so several waiters released in one pass do not all pick the
same pod. Modes:
- "reject": no route now -> 429 with Retry-After.
- "queue": wait, earliest deadline first, until a route appears or `max_queue_seconds` passes;
  every load report and every finished request re-runs the waiting attempts. A full queue or an
  expired wait is a 429 with Retry-After.
In both modes a request for which no pod is routable at all gets 503 at once.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.errors import APIError, rate_limited, unavailable
from router.metrics import RouterMetrics
from router.policy.base import NoRoute, RoutingDecision

TryRoute = Callable[[], "RoutingDecision | NoRoute"]


@dataclass(order=True)
class _Waiter:
    deadline: float
    seq: int
    try_route: TryRoute = field(compare=False)
    future: asyncio.Future = field(compare=False)
    last: NoRoute = field(compare=False)


class AdmissionController:
    """Decides, per request, between routing now, waiting, and refusing."""

    def __init__(self, mode: str, max_queue_seconds: float, max_queue_size: int,
                 metrics: RouterMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if mode not in ("queue", "reject"):
            raise ValueError(f"admission mode must be 'queue' or 'reject', got {mode!r}")
        self.mode = mode
        self.max_queue_seconds = max_queue_seconds
        self.max_queue_size = max_queue_size
        self.metrics = metrics
        self.clock = clock        # the event loop's clock (the capacity planner's is virtual)
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self._pass_scheduled = False

    @property
    def num_waiting(self) -> int:
        return sum(1 for w in self._heap if not w.future.done())

    def _refuse(self, reason: str, no_route: NoRoute) -> APIError:
        if self.metrics is not None:
            self.metrics.rejected(reason)
        if no_route.reason == "no_pods":
            return unavailable("No prefill/decode pod is ready to serve this request.", code="no_ready_pods")
        messages = {
            "slo": "The server cannot meet this request's latency SLO now; retry later.",
            "queue_full": "The router's admission queue is full; retry later.",
            "queue_timeout": "No pod could take this request within the admission deadline; retry later.",
        }
        return rate_limited(messages[reason], no_route.retry_after_seconds)

    async def admit(self, try_route: TryRoute, deadline: float | None = None,
                    release: Callable[[RoutingDecision], None] | None = None,
                    slo_wait_seconds: float | None = None) -> RoutingDecision:
        """A routing decision, or raises APIError (429 / 503). `deadline` is monotonic seconds.

        `slo_wait_seconds` (the request's TTFT SLO) bounds a wait for SLO headroom: a request
        still waiting after it can no longer meet its TTFT, so admitting it then would only take
        capacity from requests that still can. Shedding it keeps goodput near capacity under
        overload instead of collapsing into a queue of late requests.

        `release` undoes a reservation made by `try_route` whose waiter went away (the client
        disconnected) in the instant it was released.
        """
        if not self._heap:
            first = try_route()
            if isinstance(first, RoutingDecision):
                return first
        else:
            # Others are already waiting: join the queue rather than overtake them.
            first = NoRoute("slo")
        if first.reason == "no_pods":
            # Nothing to wait for: no pod that could take it is routable now, and a pod coming back
            # takes longer than a request should sit here (clients retry after Retry-After).
            raise self._refuse("no_pods", first)
        if self.mode == "reject":
            raise self._refuse("slo", first)
        if self.num_waiting >= self.max_queue_size:
            raise self._refuse("queue_full", first)

        now = self.clock()
        queue_deadline = now + self.max_queue_seconds
        if slo_wait_seconds is not None and first.reason != "no_pods":
            queue_deadline = min(queue_deadline, now + slo_wait_seconds)
        if deadline is not None:
            queue_deadline = min(queue_deadline, deadline)
        waiter = _Waiter(queue_deadline, next(self._seq), try_route,
                         asyncio.get_running_loop().create_future(), first)
        heapq.heappush(self._heap, waiter)
        if self.metrics is not None:
            self.metrics.waiting.inc()
        self.wake()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout=max(0.0, queue_deadline - now))
        except asyncio.TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():
                return waiter.future.result()   # released in the same instant it timed out
            waiter.future.cancel()
            raise self._refuse("no_pods" if waiter.last.reason == "no_pods" else "queue_timeout",
                               waiter.last) from None
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and release is not None:
                release(waiter.future.result())
            raise
        finally:
            if not waiter.future.done():
                waiter.future.cancel()   # the client went away while waiting
            if self.metrics is not None:
                self.metrics.waiting.dec()

    def wake(self) -> None:
        """Something changed (a load report, a finished request): retry the waiters soon."""
        if self._heap and not self._pass_scheduled:
            self._pass_scheduled = True
            asyncio.get_running_loop().call_soon(self._run_pass)

    def _run_pass(self) -> None:
        """Retry every waiter in deadline order; release those that route, keep the rest."""
        self._pass_scheduled = False
        kept = []
        while self._heap:
            waiter = heapq.heappop(self._heap)
            if waiter.future.done():
                continue
            result = waiter.try_route()
            if isinstance(result, RoutingDecision):
                waiter.future.set_result(result)
            else:
                waiter.last = result
                kept.append(waiter)
        for waiter in kept:
            heapq.heappush(self._heap, waiter)
