"""Static discovery: the `--prefill`, `--decode` or `--colocated` addresses, fixed for the run."""

from __future__ import annotations

from router.discovery.base import Discovery, PodEndpoint


class StaticDiscovery(Discovery):
    """A fixed list of endpoints; whether each is routable is decided by health probes, not here."""

    def __init__(self, endpoints: list[PodEndpoint]) -> None:
        super().__init__()
        self._static = frozenset(endpoints)

    @classmethod
    def from_config(cls, config) -> StaticDiscovery:
        endpoints = [PodEndpoint(a, role, a) for role in ("prefill", "decode", "colocated")
                     for a in getattr(config, role)]
        return cls(endpoints)

    async def start(self) -> None:
        self._publish(self._static)

    async def stop(self) -> None:
        return None
