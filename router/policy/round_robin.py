"""round_robin: every routable pod in turn, ignoring load (a baseline for benchmarks)."""

from __future__ import annotations

from router.load import PodState
from router.policy.base import Policy, Profile


class RoundRobinPicker:
    """Picks pods in address order, one after the other, whatever their scores."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, pods: list[PodState], scores: dict[str, float]) -> PodState:
        ordered = sorted(pods, key=lambda p: p.address)
        pod = ordered[self._next % len(ordered)]
        self._next += 1
        return pod


def round_robin_policy() -> Policy:
    policy = Policy(Profile(picker=RoundRobinPicker()), Profile(picker=RoundRobinPicker()),
                    Profile(picker=RoundRobinPicker()))
    policy.name = "round_robin"
    return policy
