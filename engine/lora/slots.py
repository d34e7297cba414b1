"""Which adapter is in which device slot, and which requests hold each slot; pure Python.

A request with an adapter holds a slot from its admission into the batch (or, on a decode pod,
from the reservation of its blocks) until it leaves the batch: finished, aborted, preempted,
prefilled. Adapters whose requests are all gone stay in their slot (LRU), so the next request
for one needs no copy; a new adapter takes an empty slot first, then the least recently used
idle one. When every slot serves running requests of other adapters, a request waits: the
scheduler stops admitting at it (head of line, as it does when blocks run short), so at most
`num_slots` adapters are ever in one batch and a slot's weights never change under a running
request. Each assignment of an adapter to a slot queues a copy (`take_loads`) that the engine
makes before the step runs.

Keyed by the adapter's identity (its content hash), not its name: two names for the same files
share a slot, and an adapter unloaded and loaded again with other contents gets another.
"""

from __future__ import annotations

from collections import OrderedDict


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.identity: list[str | None] = [None] * num_slots    # what each slot holds
        self.users = [0] * num_slots                             # requests holding each slot
        self.slot_of_identity: dict[str, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))   # users == 0, LRU first
        # request id -> slot: the runner stages each token's slot from this (the same dict, live).
        self.slot_of_request: dict[str, int] = {}
        self._loads: list[tuple[int, object]] = []               # (slot, adapter) to copy before the step
        self.num_loads = 0

    def can_acquire(self, request) -> bool:
        """`request` (with `request.lora`) can get a slot now without evicting a running adapter."""
        if request.request_id in self.slot_of_request:
            return True
        return request.lora.identity in self.slot_of_identity or bool(self._idle)

    def acquire(self, request) -> int:
        """Give `request` its adapter's slot (loading it into one if needed); call only after
        `can_acquire` said yes. Idempotent per request."""
        slot = self.slot_of_request.get(request.request_id)
        if slot is not None:
            return slot
        identity = request.lora.identity
        slot = self.slot_of_identity.get(identity)
        if slot is None:
            slot = self._evictable()
            old = self.identity[slot]
            if old is not None:
                del self.slot_of_identity[old]
            self.identity[slot] = identity
            self.slot_of_identity[identity] = slot
            self._loads.append((slot, request.lora.adapter))
            self.num_loads += 1
        if self.users[slot] == 0:
            del self._idle[slot]
        self.users[slot] += 1
        self.slot_of_request[request.request_id] = slot
        return slot

    def _evictable(self) -> int:
        for slot in self._idle:              # an empty slot first: evict nothing while one is free
            if self.identity[slot] is None:
                return slot
        return next(iter(self._idle))        # then the least recently used idle adapter

    def release(self, request_id: str) -> None:
        """`request_id` left the batch (idempotent); its adapter stays resident while unused."""
        slot = self.slot_of_request.pop(request_id, None)
        if slot is None:
            return
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self._idle[slot] = None           # most recently used: evicted last

    def take_loads(self) -> list[tuple[int, object]]:
        """The (slot, adapter) copies assigned since the last call, in order."""
        loads, self._loads = self._loads, []
        return loads

    def resident(self, identity: str) -> bool:
        return identity in self.slot_of_identity

    def check_invariants(self) -> None:
        """For tests: users match the requests holding slots; idle = slots without users."""
        counts = [0] * self.num_slots
        for slot in self.slot_of_request.values():
            counts[slot] += 1
        assert counts == self.users, f"slot users {self.users} but requests hold {counts}"
        assert set(self._idle) == {s for s in range(self.num_slots) if self.users[s] == 0}
        assert all(self.identity[s] == i for i, s in self.slot_of_identity.items())
        assert len(self.slot_of_identity) == sum(i is not None for i in self.identity)
