"""The scheduler's waiting queues, one per admission policy: FCFS and (priority, arrival)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from engine.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    """Order of service under the `priority` policy: lower `priority`, then earlier arrival."""
    return request.priority, request.arrival_time


class FCFSQueue:
    """Arrival order; preempted and fallen-back requests re-enter at the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def unordered(self) -> Iterator[Request]:
        """Every queued request, in no promised order (for sums and checks)."""
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """(priority, arrival) order, a heap; re-entering requests simply take their place by key,
    which puts a preempted request ahead of everything that arrived after it."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()   # tie-break, so Requests are never compared

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(request), next(self._counter), request))

    push_front = push

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def unordered(self) -> Iterator[Request]:
        """Every queued request in heap order: O(n), where `iter()` sorts (O(n log n))."""
        return (entry[3] for entry in self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))
