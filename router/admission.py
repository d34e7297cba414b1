"""Admission control: admit now, wait in a bounded deadline-ordered queue, or refuse.

`try_route(headroom_waited)` is the caller's routing attempt; on success it has already reserved
the chosen pods (the router's in-flight accounting), so several waiters released in one pass do
not all pick the same pod. Its argument is how long the request has waited for SLO headroom, which
the caller takes off the request's TTFT budget. A failed attempt says why (`NoRoute.reason`), and
the reason decides what the request may wait for:

- "slo": pods are ready but none is predicted to meet the SLO. Mode "reject": 429 with Retry-After
  at once. Mode "queue": wait, earliest deadline first, until a route appears, at most
  `max_queue_seconds` and the request's TTFT SLO; then 429 with Retry-After.
- "starting": no pod that could serve is ready yet, but discovery knows such pods (starting,
  restarting after a crash, a rolling update's replacements). Wait for one, in either mode, at most
  `startup_wait_seconds`; then 503 with Retry-After. The time spent waiting for a pod to start is
  not taken off the TTFT budget: the request is served when the pod is up, not shed because its
  SLO passed while there was nothing to route to.
- "no_pods": nothing is known that could serve it: 503 at once (there is nothing to wait for).

Every load report, every change in which pods are routable and every finished request re-runs the
waiting attempts (`wake`); a waiter's latest reason sets its bound, and a timer refuses each waiter
when its bound passes. A full queue is a 429 at once. Every wait ends by the request's deadline.
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

TryRoute = Callable[[float], "RoutingDecision | NoRoute"]
_UNTRIED = "untried"   # a waiter that joined a queue before its first attempt
# Retry-After of a 503 once the wait for a starting pod passed: a pod that is loading takes seconds.
STARTING_RETRY_AFTER_SECONDS = 5.0


@dataclass(order=True)
class _Waiter:
    order: float                                   # release order: earliest bound first
    seq: int
    try_route: TryRoute = field(compare=False)
    future: asyncio.Future = field(compare=False)
    last: NoRoute = field(compare=False)           # why its latest attempt found no route
    arrived: float = field(compare=False)          # monotonic
    deadline: float = field(compare=False)         # the request's own (monotonic; inf: none)
    slo_wait_seconds: float = field(compare=False)
    headroom_since: float | None = field(compare=False, default=None)   # first "slo" answer
    expires_at: float = field(compare=False, default=float("inf"))


class AdmissionController:
    """Decides, per request, between routing now, waiting, and refusing."""

    def __init__(self, mode: str, max_queue_seconds: float, max_queue_size: int,
                 metrics: RouterMetrics | None = None, startup_wait_seconds: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if mode not in ("queue", "reject"):
            raise ValueError(f"admission mode must be 'queue' or 'reject', got {mode!r}")
        self.mode = mode
        self.max_queue_seconds = max_queue_seconds
        self.max_queue_size = max_queue_size
        self.startup_wait_seconds = startup_wait_seconds
        self.metrics = metrics
        self.clock = clock        # the event loop's clock (the capacity planner's is virtual)
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self._pass_scheduled = False
        self._timer: asyncio.TimerHandle | None = None

    @property
    def num_waiting(self) -> int:
        return sum(1 for w in self._heap if not w.future.done())

    def _refuse(self, no_route: NoRoute, timed_out: bool = False) -> APIError:
        """The answer for a request that gets no route: 503 when there is no ready pod to route to,
        429 when ready pods are too busy for its SLO."""
        if no_route.reason in ("no_pods", "starting"):
            reason = "startup_timeout" if no_route.reason == "starting" else "no_pods"
            if self.metrics is not None:
                self.metrics.rejected(reason)
            if no_route.reason == "starting":
                return unavailable("No pod is ready yet to serve this request (pods are starting); retry later.",
                                   code="no_ready_pods", retry_after_seconds=no_route.retry_after_seconds)
            return unavailable("No prefill/decode pod is ready to serve this request.", code="no_ready_pods",
                               retry_after_seconds=no_route.retry_after_seconds)
        reason = "queue_timeout" if timed_out else "slo"
        if self.metrics is not None:
            self.metrics.rejected(reason)
        if timed_out:
            return rate_limited("No pod could take this request within the admission deadline; retry later.",
                                no_route.retry_after_seconds)
        return rate_limited("The server cannot meet this request's latency SLO now; retry later.",
                            no_route.retry_after_seconds)

    def _bound(self, waiter: _Waiter, now: float) -> float:
        """When `waiter` stops waiting, given why its latest attempt failed."""
        reason = waiter.last.reason
        if reason == _UNTRIED:
            return waiter.deadline
        if reason == "no_pods":
            return now
        if reason == "starting":
            bound = waiter.arrived + self.startup_wait_seconds
        else:
            if waiter.headroom_since is None:
                waiter.headroom_since = now
            if self.mode == "reject":   # it waited for a pod to start; now it is the SLO's call
                return now
            bound = waiter.headroom_since + min(self.max_queue_seconds, waiter.slo_wait_seconds)
        return min(bound, waiter.deadline)

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
            first = try_route(0.0)
            if isinstance(first, RoutingDecision):
                return first
        else:
            # Others are already waiting: join the queue rather than overtake them. The pass that
            # `wake` schedules finds out what this one waits for.
            first = NoRoute(_UNTRIED)
        if first.reason == "no_pods" or first.reason == "slo" and self.mode == "reject":
            raise self._refuse(first)
        if self.num_waiting >= self.max_queue_size:
            if self.metrics is not None:
                self.metrics.rejected("queue_full")
            raise rate_limited("The router's admission queue is full; retry later.", first.retry_after_seconds)

        now = self.clock()
        waiter = _Waiter(0.0, next(self._seq), try_route, asyncio.get_running_loop().create_future(), first,
                         now, float("inf") if deadline is None else deadline,
                         float("inf") if slo_wait_seconds is None else slo_wait_seconds)
        waiter.expires_at = waiter.order = self._bound(waiter, now)
        heapq.heappush(self._heap, waiter)
        if self.metrics is not None:
            self.metrics.waiting.inc()
        self.wake()
        self._arm_timer()
        try:
            return await asyncio.shield(waiter.future)
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None \
                    and release is not None:
                release(waiter.future.result())
            raise
        finally:
            if not waiter.future.done():
                waiter.future.cancel()   # the client went away while waiting
            if self.metrics is not None:
                self.metrics.waiting.dec()

    def wake(self) -> None:
        """Something changed (a load report, a pod routable or not, a finished request): retry the
        waiters soon."""
        if self._heap and not self._pass_scheduled:
            self._pass_scheduled = True
            asyncio.get_running_loop().call_soon(self._run_pass)

    def _run_pass(self) -> None:
        """Retry every waiter in deadline order; release those that route, refuse those whose
        bound passed, keep the rest."""
        self._pass_scheduled = False
        now = self.clock()
        kept = []
        while self._heap:
            waiter = heapq.heappop(self._heap)
            if waiter.future.done():
                continue
            headroom_waited = 0.0 if waiter.headroom_since is None else now - waiter.headroom_since
            result = waiter.try_route(headroom_waited)
            if isinstance(result, RoutingDecision):
                waiter.future.set_result(result)
                continue
            waiter.last = result
            waiter.expires_at = self._bound(waiter, now)
            if waiter.expires_at <= now:
                waiter.future.set_exception(self._refuse(result, timed_out=self.mode == "queue"))
            else:
                kept.append(waiter)
        for waiter in kept:
            heapq.heappush(self._heap, waiter)
        self._arm_timer()

    def _arm_timer(self) -> None:
        """One timer, at the earliest bound of a waiter still waiting."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        bounds = [w.expires_at for w in self._heap if not w.future.done()]
        if bounds:
            self._timer = asyncio.get_running_loop().call_at(
                self._loop_time(min(bounds)), self._expire)

    def _loop_time(self, when: float) -> float:
        """`when` (seconds on `clock`) on the running loop's clock (asyncio's loop.time() is
        monotonic-based but need not be the same clock; the planner's clock is the loop's own)."""
        return asyncio.get_running_loop().time() + (when - self.clock())

    def _expire(self) -> None:
        """Refuse the waiters whose bound passed (a last attempt first: it may route now)."""
        self._timer = None
        now = self.clock()
        if any(w.expires_at <= now for w in self._heap if not w.future.done()):
            self._run_pass()
        else:
            self._arm_timer()
