"""Blocks a prefill pod keeps for a decode pod that has not pulled them yet.

When a request finishes prefill and no `PullKV` stream is open for it, its blocks are *held*
here with an expiry. A pull that arrives in time `take`s them (the open stream is then the
lease, and the stream's end releases them); if nobody comes, the pod's housekeeping calls
`expire(now)` and frees what it returns. Everything is thread-safe: the engine thread holds,
the asyncio server takes, either may release.

Time is `time.monotonic()` seconds unless a clock is injected (tests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_TTL_SECONDS = 30.0


@dataclass(frozen=True)
class HeldKV:
    """One held request: its block ids (in request order) and when they expire."""

    request_id: str
    block_ids: tuple[int, ...]
    num_prompt_tokens: int
    expires_at: float


class HeldKVTable:
    """request id -> held blocks, with a TTL, counters and a lock."""

    def __init__(self, ttl_seconds: float = DEFAULT_TTL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive, got {ttl_seconds}")
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, HeldKV] = {}
        self.num_held_total = 0  # ever held
        self.num_taken = 0       # pulled in time
        self.num_released = 0    # released without a pull (abort, client gone)
        self.num_expired = 0     # nobody pulled within the TTL

    def hold(self, request_id: str, block_ids: Sequence[int], num_prompt_tokens: int,
             ttl_seconds: float | None = None) -> HeldKV:
        """Hold `block_ids` for `request_id` until now + TTL. Holding an id again is an error:
        the engine would otherwise lose track of the first set of blocks."""
        now = self._clock()
        entry = HeldKV(request_id, tuple(block_ids), num_prompt_tokens,
                       now + (self.ttl_seconds if ttl_seconds is None else ttl_seconds))
        with self._lock:
            if request_id in self._held:
                raise KeyError(f"request {request_id!r} already holds KV blocks")
            self._held[request_id] = entry
            self.num_held_total += 1
        return entry

    def take(self, request_id: str) -> HeldKV | None:
        """A pull arrived: hand the blocks over to it (None if not held: expired, released,
        never held, or taken already). Idempotent."""
        with self._lock:
            entry = self._held.pop(request_id, None)
            if entry is not None:
                self.num_taken += 1
        return entry

    def release(self, request_id: str) -> HeldKV | None:
        """Drop the hold without a pull (abort); returns the entry so its blocks can be freed,
        None if there was none. Idempotent."""
        with self._lock:
            entry = self._held.pop(request_id, None)
            if entry is not None:
                self.num_released += 1
        return entry

    def expire(self, now: float | None = None) -> list[str]:
        """Drop every hold whose expiry has passed; returns their request ids, oldest first.
        Use `expire_entries` to get the block ids too."""
        return [entry.request_id for entry in self.expire_entries(now)]

    def expire_entries(self, now: float | None = None) -> list[HeldKV]:
        now = self._clock() if now is None else now
        with self._lock:
            expired = [entry for entry in self._held.values() if entry.expires_at <= now]
            for entry in expired:
                del self._held[entry.request_id]
            self.num_expired += len(expired)
        return sorted(expired, key=lambda entry: entry.expires_at)

    def get(self, request_id: str) -> HeldKV | None:
        with self._lock:
            return self._held.get(request_id)

    def next_expiry(self) -> float | None:
        """When the next hold expires (for the housekeeping timer), None if nothing is held."""
        with self._lock:
            return min((entry.expires_at for entry in self._held.values()), default=None)

    @property
    def num_held(self) -> int:
        """Requests held right now (`LoadReport.num_held_kv`)."""
        with self._lock:
            return len(self._held)

    @property
    def num_held_blocks(self) -> int:
        with self._lock:
            return sum(len(entry.block_ids) for entry in self._held.values())
