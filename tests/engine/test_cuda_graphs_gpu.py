"""On a GPU: decode steps replayed from CUDA graphs, async scheduling, and speculative verification
replayed from its graphs (fixed draft width, `engine.spec_decode.verify_graphs`) give the eager,
synchronous engine's tokens (greedy and seeded). Skipped without CUDA."""

from __future__ import annotations

import random

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from engine.spec_decode.adaptive import FixedController
from engine.spec_decode.config import SpeculativeConfig

pytestmark = pytest.mark.gpu


def _engine(**overrides) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cuda", dtype="float32",
                               cache=CacheConfig(block_size=16, num_blocks=512),
                               scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32),
                               **overrides))


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[1] + [rng.randrange(3, 259) for _ in range(rng.randrange(5, 300))] for _ in range(n)]


def test_graph_replay_and_async_scheduling_equal_eager_synchronous_steps():
    prompts = _prompts(20)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in range(10)] + \
             [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=16 + s) for s in range(10)]
    eager = _engine(enforce_eager=True, async_scheduling=False)
    assert eager.runner.decode_buckets is None
    want = [o.output_token_ids for o in eager.generate(prompts, params)]
    graphs = _engine(async_scheduling=False)
    assert graphs.runner.decode_buckets.graphs      # captured
    assert [o.output_token_ids for o in graphs.generate(prompts, params)] == want
    both = _engine()
    assert both.async_scheduling
    assert [o.output_token_ids for o in both.generate(prompts, params)] == want
    assert both.stats().kv_cache_usage == 0.0
    # Speculation (n-gram, k 4, drafting every step it can): verification replays its graphs.
    spec = _engine(async_scheduling=False, speculative=SpeculativeConfig("ngram", 4, prompt_lookup_min=1,
                                                                         prompt_lookup_max=3))
    spec.spec.controller = FixedController(4)
    verify = spec.runner.verify_buckets
    assert verify.graphs and verify.query_width == 5
    replays = []
    run = verify.run
    verify.run = lambda seqs, bucket, *rest: (replays.append(bucket in verify.graphs), run(seqs, bucket, *rest))[1]
    assert [o.output_token_ids for o in spec.generate(prompts, params)] == want
    assert replays and all(replays) and spec.stats().spec_decode.num_drafts > 0
    assert spec.stats().kv_cache_usage == 0.0
