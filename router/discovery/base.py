"""The discovery interface: a current set of ready pod endpoints, and a callback on every change.

Discovery knows only addresses and roles. What the router learns by talking to a pod (its load, its
health, its model) lives in `router.load`; a pod that discovery still lists may be taken out of
routing there after a failed call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

Listener = Callable[[frozenset["PodEndpoint"]], None]


@dataclass(frozen=True)
class PodEndpoint:
    """One routable pod: gRPC `address` ("host:port"), `role` prefill|decode|colocated, and a name."""

    address: str
    role: str
    pod_id: str = ""


class Discovery(ABC):
    """Tracks ready endpoints; `subscribe` listeners get the full new set after every change."""

    def __init__(self) -> None:
        self._endpoints: frozenset[PodEndpoint] = frozenset()
        self._listeners: list[Listener] = []

    def endpoints(self) -> frozenset[PodEndpoint]:
        return self._endpoints

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)
        listener(self._endpoints)

    def _publish(self, endpoints: frozenset[PodEndpoint]) -> None:
        """Set the current endpoints (call on the event loop's thread) and tell every listener."""
        if endpoints == self._endpoints:
            return
        self._endpoints = endpoints
        for listener in self._listeners:
            listener(endpoints)

    @abstractmethod
    async def start(self) -> None:
        """Begin discovering; returns once the first set of endpoints is known (or failed loudly)."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop watching and release resources."""
