"""On a GPU: no Triton compile after the engine's start-up, across a sweep of mixed and decode
batches of every size (the target behind `test_kernel_variants.py`'s CPU check). Skipped without CUDA.

Counts the compiled variants in every jitted kernel's per-device cache (`JITFunction.device_caches`)
after `Engine()` returns, serves prompts of many lengths (prefill chunks beside decodes, decode
batches that grow and shrink, graph and eager contexts), and counts again."""

from __future__ import annotations

import importlib
import random
from pathlib import Path

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.gpu

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _compiled() -> dict[str, int]:
    """Kernel name -> compiled variants, over every device."""
    counts = {}
    for path in sorted(KERNELS.glob("*_triton.py")):
        module = importlib.import_module(f"kernels.{path.stem}")
        for name, obj in vars(module).items():
            caches = getattr(obj, "device_caches", None)
            if name.endswith("_kernel") and caches is not None:
                counts[f"{path.stem}.{name}"] = sum(len(entry[0]) for entry in caches.values())
    return counts


@pytest.mark.parametrize("role", ["colocated", "prefill"])
def test_no_compile_after_start_up(role):
    engine = Engine(EngineConfig(model="tiny", device="cuda", dtype="bfloat16", role=role,
                                 cache=CacheConfig(block_size=16, num_blocks=2048),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=48)))
    assert (engine.runner.decode_buckets is None) == (role == "prefill")
    before = _compiled()
    assert sum(before.values()) > 0
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(3, 259) for _ in range(rng.choice([1, 5, 40, 300, 1500]))] for _ in range(60)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 48), ignore_eos=True) for _ in prompts]
    engine.generate(prompts, params)
    after = _compiled()
    grew = {name: (before.get(name, 0), n) for name, n in after.items() if n != before.get(name, 0)}
    assert not grew, f"compiled while serving (before, after): {grew}"
