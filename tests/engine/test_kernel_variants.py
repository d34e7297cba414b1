"""No Triton compile after start-up: across a sweep of decode and mixed batches, every launch's
specialisation key (what Triton looks its compiled kernels up by: constexprs, pointer alignment,
the integers it keys on) is one the start-up already met.

On CPU: the real runner, model and launchers, with every jitted kernel replaced by a recorder of
its key (`triton_keys.KeyRecorder`; nothing is compiled or run, so the step's values are garbage
and nothing reads them). Start-up is what the engine runs before its first request: the eager
warm-up (`engine.runner.warmup`) and one step of every decode bucket (what capture runs before
it captures). The CPU launchers pick CPU tile sizes, so the keys are not the GPU's, but the rules
that make them vary with the batch are the same code."""

from __future__ import annotations

import random

import pytest
import torch

from engine.cuda_graphs import MAX_GRAPH_CONTEXT
from engine.kv_cache import allocate_kv_cache
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner, PrevSample
from engine.presets import resolve_model_dir
from engine.runner.warmup import warm_up
from engine.scheduling.output import PLACEHOLDER_TOKEN_ID, ScheduledSeq
from kernels import backend
from triton_keys import KeyRecorder

pytest.importorskip("triton")

BLOCK = 16
MAX_LEN = 2 * MAX_GRAPH_CONTEXT       # contexts past the graphs run eagerly: those too
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def runner():
    path = resolve_model_dir("tiny")
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, torch.float32, CPU, MAX_LEN + 1)
    return ModelRunner(model, allocate_kv_cache(cfg, 8, BLOCK, torch.float32, CPU), BLOCK, CPU, max_num_seqs=32,
                       max_num_batched_tokens=256, max_model_len=MAX_LEN, enforce_eager=False)


@pytest.fixture
def recorder(monkeypatch):
    previous = backend.set_backend(backend.TRITON)
    try:
        yield KeyRecorder(monkeypatch)
    finally:
        backend.set_backend(previous)


def _decode(rng: random.Random, rid: str, placeholder: bool) -> ScheduledSeq:
    context = rng.choice([rng.randrange(1, 600), rng.randrange(1, MAX_GRAPH_CONTEXT + 1), rng.randrange(1, MAX_LEN + 1)])
    token = PLACEHOLDER_TOKEN_ID if placeholder else rng.randrange(100)
    return ScheduledSeq(rid, (token,), context - 1, tuple(rng.randrange(8) for _ in range(-(-context // BLOCK))), True)


def _batches(seed: int, count: int):
    """(batch, prev) pairs: decode-only batches of 1..32 sequences and mixed batches of prefill
    chunks (some mid-prompt) beside decodes, within the 256-token budget."""
    rng = random.Random(seed)
    for i in range(count):
        n = rng.randrange(1, 33)
        decodes = [_decode(rng, f"d{i}-{j}", rng.random() < 0.5) for j in range(n)]
        if rng.random() < 0.5:
            budget = 256 - n
            chunks = []
            while budget > 1 and len(chunks) < 4:
                length = rng.randrange(2, min(budget, 200) + 1)
                start = rng.randrange(0, 3000)
                chunks.append(ScheduledSeq(f"p{i}-{len(chunks)}", tuple(rng.randrange(100) for _ in range(length)),
                                           start, tuple(rng.randrange(8) for _ in range(-(-(start + length) // BLOCK))),
                                           rng.random() < 0.5))
                budget -= length
            batch = decodes[: rng.randrange(0, n + 1)] + chunks
        else:
            batch = decodes
        waiting = [s.request_id for s in batch if s.token_ids == (PLACEHOLDER_TOKEN_ID,)]
        prev = PrevSample(torch.zeros(len(waiting) + 1, dtype=torch.long), {rid: k for k, rid in enumerate(waiting)})
        yield batch, prev


def test_no_new_kernel_variant_after_start_up(runner, recorder):
    warm_up(runner)
    for bs in runner.decode_buckets.batch_sizes:
        runner.decode_buckets.run([], bs)          # what capture runs before capturing bucket bs
    startup, startup_raw = recorder.take()
    assert startup and {name for name, _ in startup} >= {"attention_triton._unified_attention_kernel",
                                                         "attention_splitk_triton._split_k_reduce_kernel"}
    for batch, prev in _batches(seed=11, count=120):
        runner.run(batch, prev)
    seen, seen_raw = recorder.take()
    new = sorted(seen - startup)
    assert not new, f"{len(new)} kernel variants first met while serving, e.g. {new[0][0]}: {new[0][1]}"
    # Every pointer is 16-byte aligned, the staged step inputs included.
    for name, (specialization, _) in seen:
        assert all(kind != "" for ty, kind in specialization if str(ty).startswith("*")), name
    # The sweep does vary what Triton would key on, were nothing kept out of the key.
    assert seen_raw - startup_raw


def test_the_attention_kernels_keep_one_variant_per_step_kind(runner, recorder):
    """Decode-only and mixed steps of every size: at most two unified-kernel variants (decode,
    prefill tiles) and one split-K partial kernel."""
    for batch, prev in _batches(seed=5, count=60):
        runner.run(batch, prev)
    seen, _ = recorder.take()
    per_kernel: dict[str, int] = {}
    for name, _ in seen:
        per_kernel[name] = per_kernel.get(name, 0) + 1
    assert per_kernel["attention_triton._unified_attention_kernel"] <= 2
    assert per_kernel.get("attention_splitk_triton._split_k_partial_kernel", 0) <= 1
