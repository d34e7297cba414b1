from __future__ import annotations

import threading

import pytest

from kvtransfer.leases import HeldKVTable


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_hold_take_release_are_idempotent():
    table = HeldKVTable(ttl_seconds=30, clock=FakeClock())
    table.hold("a", [3, 4], num_prompt_tokens=20)
    table.hold("b", [5], num_prompt_tokens=3)
    assert table.num_held == 2 and table.num_held_blocks == 3
    entry = table.take("a")
    assert entry is not None and entry.block_ids == (3, 4) and entry.expires_at == 130.0
    assert table.take("a") is None
    assert table.release("b").block_ids == (5,)
    assert table.release("b") is None and table.release("never") is None
    assert (table.num_taken, table.num_released, table.num_held) == (1, 1, 0)


def test_double_hold_is_refused():
    table = HeldKVTable()
    table.hold("a", [1], 4)
    with pytest.raises(KeyError, match="already holds"):
        table.hold("a", [2], 4)


def test_expire_returns_only_past_holds_in_order():
    clock = FakeClock()
    table = HeldKVTable(ttl_seconds=30, clock=clock)
    table.hold("late", [1], 4, ttl_seconds=10)
    clock.now = 101.0
    table.hold("early", [2], 4, ttl_seconds=5)
    table.hold("kept", [3], 4)
    assert table.next_expiry() == 106.0
    assert table.expire(now=105.0) == []
    assert table.expire(now=110.0) == ["early", "late"]
    assert table.num_expired == 2 and table.num_held == 1
    assert table.take("early") is None  # an expired hold cannot be pulled any more
    clock.now = 200.0
    assert [e.block_ids for e in table.expire_entries()] == [(3,)]


def test_concurrent_take_hands_blocks_to_exactly_one_caller():
    table = HeldKVTable()
    for i in range(200):
        table.hold(f"r{i}", [i + 1], 4)
    got: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        for i in range(200):
            if table.take(f"r{i}") is not None:
                with lock:
                    got.append(f"r{i}")

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == sorted(f"r{i}" for i in range(200)) and table.num_taken == 200
