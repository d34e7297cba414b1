"""On a GPU: grammar masks after CUDA-graph logits and with async scheduling (the CUDA default)
give the eager, synchronous engine's tokens, all valid; the mask rides a pinned, non-blocking
copy. Skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from tests.engine.structured_cases import SMALL_SPECS, SPECS, check_complete

pytestmark = pytest.mark.gpu


def _engine(**overrides) -> Engine:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return Engine(EngineConfig(model="tiny", device="cuda", dtype="float32",
                               cache=CacheConfig(block_size=16, num_blocks=512),
                               scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32), **overrides))


def test_masks_with_cuda_graphs_and_async_scheduling_equal_eager_sync():
    rng = random.Random(3)
    prompts, params = [], []
    for k, spec in enumerate([*SMALL_SPECS.values(), SPECS["json"]]):
        for s in range(4):
            prompts.append([1] + [rng.randrange(4, 259) for _ in range(rng.randrange(5, 200))])
            params.append(SamplingParams(temperature=0.0 if s == 0 else 0.9, seed=10 * k + s, max_tokens=64,
                                         structured=spec))
    prompts.append([1, 50, 60])
    params.append(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    eager = _engine(enforce_eager=True, async_scheduling=False)
    want = [(o.output_token_ids, o.finish_reason) for o in eager.generate(prompts, params)]
    both = _engine()
    assert both.async_scheduling and both.runner.decode_buckets.graphs
    outs = both.generate(prompts, params)
    assert [(o.output_token_ids, o.finish_reason) for o in outs] == want
    for out, sp in zip(outs, params):
        if sp.structured is not None and out.finish_reason == "stop":
            check_complete(sp.structured, out.text)
