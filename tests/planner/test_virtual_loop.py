"""The virtual-time loop: waits cost no wall time, timers run in time order and, at one instant, in
the order they were set; a simulation where everything waits forever is an error, not a hang."""

from __future__ import annotations

import asyncio
import time

import pytest

from cbserve.planner.virtual_loop import Deadlock, run_virtual


def test_sleep_and_timeouts_take_virtual_time_only():
    async def main():
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        await asyncio.sleep(3600)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.sleep(10), 2.5)
        return loop.time(), time.perf_counter() - started
    virtual, wall = run_virtual(main())
    assert virtual == pytest.approx(3602.5)
    assert wall < 5.0          # a ceiling, not a speed target: the hour took no hour


def test_timers_at_one_instant_run_in_the_order_they_were_set():
    async def main():
        loop = asyncio.get_running_loop()
        order = []
        for i in range(50):
            loop.call_at(1.0, order.append, i)
        loop.call_at(0.5, order.append, "early")
        await asyncio.sleep(2)
        return order
    assert run_virtual(main()) == ["early", *range(50)]


def test_tasks_interleave_by_virtual_time():
    async def main():
        loop = asyncio.get_running_loop()
        seen = []

        async def worker(name, period, count):
            for _ in range(count):
                await asyncio.sleep(period)
                seen.append((round(loop.time(), 6), name))
        await asyncio.gather(worker("a", 0.3, 3), worker("b", 0.5, 2))
        return seen
    assert run_virtual(main()) == [(0.3, "a"), (0.5, "b"), (0.6, "a"), (0.9, "a"), (1.0, "b")]


def test_a_simulation_that_can_never_progress_is_a_deadlock():
    async def main():
        await asyncio.get_running_loop().create_future()
    with pytest.raises(Deadlock, match="deadlocked"):
        run_virtual(main())
