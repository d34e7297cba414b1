"""`EngineLoop` hands a step's outputs to the event loop at once; `drain` takes all that is queued."""

from __future__ import annotations

import asyncio

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.loop import EngineLoop, drain
from engine.sampling.params import SamplingParams


def test_drain_waits_for_one_item_then_takes_the_rest():
    async def scenario():
        q: asyncio.Queue = asyncio.Queue()
        waiting = asyncio.ensure_future(drain(q))
        await asyncio.sleep(0)
        assert not waiting.done()
        q.put_nowait(1)
        q.put_nowait(2)            # queued before the consumer runs: taken in the same wake
        first = await waiting
        q.put_nowait(3)
        return first, await drain(q), q.empty()

    assert asyncio.run(scenario()) == ([1, 2], [3], True)


def test_a_slow_subscriber_gets_several_tokens_per_wake_in_order():
    engine = Engine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=64),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    prompt, params = [1, 5, 9, 13], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (want,) = engine.generate([prompt], params)

    async def scenario():
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        try:
            outputs = loop.subscribe("r")
            await loop.run(lambda e: e.add_request(prompt, params, request_id="r"))
            wakes, tokens, finished = 0, [], False
            while not finished:
                batch = await drain(outputs)
                wakes += 1
                tokens += [t for out in batch for t in out.new_token_ids]
                finished = batch[-1].finished
                await asyncio.sleep(0.1)       # a slow client: steps pile up meanwhile
            return wakes, tokens
        finally:
            loop.stop()

    wakes, tokens = asyncio.run(scenario())
    assert tokens == want.output_token_ids
    assert wakes < len(tokens)
