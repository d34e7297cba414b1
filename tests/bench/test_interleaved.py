"""`bench.interleaved`: arms stepped in turns, all at once or at a fixed concurrency."""

from __future__ import annotations

from bench.interleaved import run_interleaved
from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams


def _engine() -> Engine:
    return Engine(EngineConfig(model="tiny", detokenize=False, cache=CacheConfig(num_blocks=64),
                               scheduler=SchedulerConfig(max_num_seqs=8)))


def test_a_fixed_concurrency_keeps_that_many_running_and_gives_every_request_its_tokens():
    engines = {"a": _engine(), "b": _engine()}
    prompts = [[1, 5 + i, 9, 13] for i in range(7)]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + i % 3, ignore_eos=True) for i in range(7)]
    running = {arm: [] for arm in engines}
    for arm, engine in engines.items():        # how many requests each step found in the engine
        step = engine.step
        engine.step = lambda step=step, engine=engine, arm=arm: (
            running[arm].append(len(engine.scheduler.running) + len(engine.scheduler.waiting)), step())[1]
    at_once = run_interleaved({"c": _engine()}, prompts, params)["c"]
    runs = run_interleaved(engines, prompts, params, concurrency=2)
    for arm, run in runs.items():
        assert max(running[arm]) == 2 and running[arm][0] == 2            # never more than 2 at a time
        assert sorted(map(len, run.tokens.values())) == sorted(p.max_tokens for p in params)
        assert sorted(run.tokens.values()) == sorted(at_once.tokens.values())   # greedy: the same outputs
        assert 0 < run.steady_clock < run.clock and 0 < run.steady_tokens < sum(map(len, run.tokens.values()))
        assert run.steady_throughput > 0 and run.tpot > 0
    assert at_once.steady_throughput == at_once.throughput             # all at once: no steady part
