"""KV cache sizing: the CUDA rule's arithmetic on made-up numbers, the refusals, the precedence of
the size flags, and the profiling step itself on the tiny model (CPU: it runs, nothing to measure)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import kv_sizing
from engine.config import CacheConfig
from engine.engine import Engine, EngineConfig
from engine.kv_cache import allocate_kv_cache, bytes_per_block
from engine.kv_sizing import (CUDA_GRAPH_POOL_BYTES, NCCL_BYTES, GiB, MemorySnapshot, MiB, Profile, ProfileBatch,
                              check_startup_memory, headroom_bytes, kv_budget, measure_startup_memory,
                              num_blocks_for_budget, profile_peak_memory, run_profile_step, size_cache,
                              wants_profile)
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.presets import resolve_model_dir
from engine.sampling.sampler import Sampler
from engine.sampling.params import MAX_LOGPROBS

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
TOTAL = 140 * GiB
# One H200-like pod: 0.5 GiB CUDA context before loading; after the profile 16 GiB of weights + 3 GiB
# of activations at the peak, torch holding 20 GiB, and 0.25 GiB more of cuBLAS/Triton workspaces.
STARTUP = MemorySnapshot(total=TOTAL, free=TOTAL - GiB // 2)
PROFILED = MemorySnapshot(total=TOTAL, free=TOTAL - GiB // 2 - 20 * GiB - GiB // 4, torch_reserved=20 * GiB,
                          torch_peak_allocated=19 * GiB)


def test_snapshot_non_torch_is_used_minus_torch_reserved():
    assert PROFILED.non_torch == GiB // 2 + GiB // 4
    assert MemorySnapshot(total=10, free=10, torch_reserved=3).non_torch == 0   # never negative


def test_headroom_is_the_graph_pool_plus_nccl():
    assert headroom_bytes() == CUDA_GRAPH_POOL_BYTES + NCCL_BYTES == 1536 * MiB
    assert headroom_bytes(cuda_graph_pool_bytes=0) == NCCL_BYTES
    assert headroom_bytes(cuda_graph_pool_bytes=2 * GiB, nccl_bytes=0) == 2 * GiB


def test_kv_bytes_is_share_minus_peak_minus_non_torch_growth_minus_headroom():
    budget = kv_budget(STARTUP, PROFILED, 0.9)
    assert budget.requested == int(0.9 * TOTAL)
    assert (budget.peak_torch, budget.non_torch_increase, budget.headroom) == (19 * GiB, GiB // 4, headroom_bytes())
    assert budget.kv_bytes == int(0.9 * TOTAL) - 19 * GiB - GiB // 4 - headroom_bytes()
    assert kv_budget(STARTUP, PROFILED, 0.9, headroom=0).kv_bytes == budget.kv_bytes + headroom_bytes()
    block = 512 * 1024   # the `small`-like block of the review note: 16 layers x 2 x 16 x 8 x 64 x 2 B
    assert num_blocks_for_budget(budget, block, 0.9) == budget.kv_bytes // block
    assert "GiB for the KV cache" in budget.describe()


def test_another_process_on_the_device_is_not_charged_to_this_pod():
    # A prefill pod already holds 60 GiB when this decode pod starts: it sees it as non-torch memory
    # at startup and after its profile alike, so only its own growth counts.
    other = 60 * GiB
    startup = dataclasses.replace(STARTUP, free=STARTUP.free - other)
    profiled = dataclasses.replace(PROFILED, free=PROFILED.free - other)
    assert profiled.non_torch - PROFILED.non_torch == other
    assert kv_budget(startup, profiled, 0.45).kv_bytes == kv_budget(STARTUP, PROFILED, 0.45).kv_bytes


@pytest.mark.parametrize("util, free, ok", [
    (0.9, TOTAL - GiB // 2, True),         # an empty device
    (0.9, int(0.9 * TOTAL), True),         # exactly the share
    (0.9, int(0.9 * TOTAL) - 1, False),
    (0.45, 70 * GiB, True),                # the second of two pods sharing the device
    (1.0, TOTAL - GiB // 2, False),        # the CUDA context alone makes 1.0 impossible
])
def test_startup_refuses_a_share_that_is_not_free(util, free, ok):
    snapshot = MemorySnapshot(total=TOTAL, free=free)
    if ok:
        check_startup_memory(snapshot, util)
        return
    with pytest.raises(RuntimeError) as err:
        check_startup_memory(snapshot, util)
    message = str(err.value)
    assert "--gpu-memory-utilization" in message and f"{free / GiB:.2f} GiB is free" in message
    assert f"at most {free / TOTAL:.3f}" in message


@pytest.mark.parametrize("util", [0.1, 0.13])
def test_no_room_for_the_cache_is_refused_with_the_numbers_and_the_flags(util):
    budget = kv_budget(STARTUP, PROFILED, util)   # 14 GiB / 18.2 GiB < 19 GiB of weights + activations
    assert budget.kv_bytes <= 0
    with pytest.raises(RuntimeError) as err:
        num_blocks_for_budget(budget, 512 * 1024, util)
    message = str(err.value)
    assert f"--gpu-memory-utilization {util:g}" in message and "19.00 GiB peak torch" in message
    assert "--kv-cache-memory-mb" in message and "--num-blocks" in message


def test_a_budget_for_fewer_than_two_blocks_is_refused():
    budget = kv_budget(STARTUP, PROFILED, 0.9, headroom=0)
    block = budget.kv_bytes - 1   # one block fits, two do not
    with pytest.raises(RuntimeError, match="at least 2"):
        num_blocks_for_budget(budget, block, 0.9)


@pytest.mark.parametrize("kwargs, error", [
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=-0.5), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.01), "gpu_memory_utilization"),
    (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes"),
    (dict(gpu_memory_utilization=1.0), None),
    (dict(gpu_memory_utilization=0.45, kv_cache_memory_bytes=None), None),
])
def test_cache_config_checks_the_sizing_fields(kwargs, error):
    if error is None:
        CacheConfig(**kwargs)
        return
    with pytest.raises(ValueError, match=error):
        CacheConfig(**kwargs)


@pytest.mark.parametrize("cache, device, profiles", [
    (CacheConfig(), CUDA, True),
    (CacheConfig(gpu_memory_utilization=0.45), CUDA, True),
    (CacheConfig(kv_cache_memory_bytes=GiB), CUDA, False),
    (CacheConfig(num_blocks=64), CUDA, False),
    (CacheConfig(), CPU, False),
    (CacheConfig(gpu_memory_utilization=0.45), CPU, False),   # unused on CPU
])
def test_only_cuda_without_an_explicit_size_profiles(cache, device, profiles):
    assert wants_profile(cache, device) is profiles


@pytest.mark.parametrize("tokens, seqs, max_len, lens", [
    (512, 128, 2048, (4,) * 128),          # the engine's defaults
    (2048, 256, 4096, (8,) * 256),         # the chart's decode pool
    (100, 128, 2048, (1,) * 100),          # never more sequences than tokens
    (10, 3, 2048, (4, 3, 3)),              # spread evenly, remainder first
    (8192, 1, 2048, (2048,)),              # nor a sequence longer than max_model_len
    (8192, 3, 2048, (2048, 2048, 2048)),
])
def test_profile_batch_is_the_largest_step_the_scheduler_can_plan(tokens, seqs, max_len, lens):
    batch = ProfileBatch.worst_case(tokens, seqs, max_len)
    assert batch.query_lens == lens
    assert (batch.num_tokens, batch.num_seqs) == (sum(lens), len(lens))


# ---------------------------------------------------------------------------------- the tiny model on CPU
@pytest.fixture(scope="module")
def tiny():
    model_dir = resolve_model_dir("tiny")
    cfg = ModelConfig.from_dir(model_dir)
    return load_model(model_dir, cfg, torch.float32, CPU, cfg.max_model_len + 1)


def test_profile_step_samples_every_sequence_and_writes_no_kv(tiny):
    batch = ProfileBatch.worst_case(100, 7, 2048)   # prefill chunks of 15/14 tokens over 2 blocks
    kv = allocate_kv_cache(tiny.cfg, 3, 8, torch.float32, CPU)
    out = run_profile_step(tiny, kv, batch, Sampler(eos_token_ids=(2,)))
    assert len(out.token_ids) == batch.num_seqs
    assert all(0 <= t < tiny.cfg.vocab_size and t != 2 for t in out.token_ids)   # min_tokens bans eos
    assert all(lp is not None and len(lp.top) == MAX_LOGPROBS for lp in out.logprobs)
    assert not kv.any()   # every slot is -1: the cache is only read


def test_profile_step_runs_on_cpu_and_measures_nothing(tiny):
    batch = ProfileBatch.worst_case(64, 16, 2048)   # decode-shaped: many short sequences
    profile = profile_peak_memory(tiny, batch, 16, torch.float32, CPU, Sampler(eos_token_ids=(2,)))
    assert profile == Profile(batch, None)
    assert measure_startup_memory(CacheConfig(), CPU) is None


def _size(tiny, cache: CacheConfig, device=CPU, startup=None) -> CacheConfig:
    return size_cache(cache, tiny, torch.float32, device, ProfileBatch.worst_case(64, 8, 2048),
                      Sampler(eos_token_ids=(2,)), startup)


def test_explicit_sizes_win_and_cpu_keeps_its_byte_default(tiny):
    block = bytes_per_block(tiny.cfg, 16, torch.float32)
    assert block == 64 * 1024
    assert _size(tiny, CacheConfig()).num_blocks == (256 * MiB) // block
    assert _size(tiny, CacheConfig(gpu_memory_utilization=0.1)).num_blocks == (256 * MiB) // block
    assert _size(tiny, CacheConfig(kv_cache_memory_bytes=8 * MiB)).num_blocks == 128
    assert _size(tiny, CacheConfig(num_blocks=7, kv_cache_memory_bytes=8 * MiB)).num_blocks == 7
    cache = CacheConfig(block_size=32, enable_prefix_caching=False)
    assert _size(tiny, cache) == dataclasses.replace(cache, num_blocks=(256 * MiB) // (2 * block))


def test_cuda_path_sizes_from_the_profile(tiny, monkeypatch, caplog):
    """The CUDA branch end to end with a made-up profile (the tiny model stays on CPU)."""
    seen = {}

    def fake_profile(model, batch, block_size, dtype, device, sampler):
        seen.update(batch=batch, device=device)
        return Profile(batch, PROFILED)

    monkeypatch.setattr(kv_sizing, "profile_peak_memory", fake_profile)
    block = bytes_per_block(tiny.cfg, 16, torch.float32)
    caplog.set_level("INFO", logger="engine.kv_sizing")
    sized = _size(tiny, CacheConfig(gpu_memory_utilization=0.5), CUDA, STARTUP)
    expected = kv_budget(STARTUP, PROFILED, 0.5).kv_bytes // block
    assert sized.num_blocks == expected and seen["device"] == CUDA
    assert f"= {expected * 16} tokens" in caplog.text and "--gpu-memory-utilization 0.5" in caplog.text
    assert _size(tiny, CacheConfig(), CUDA, STARTUP).num_blocks == kv_budget(STARTUP, PROFILED, 0.9).kv_bytes // block
    with pytest.raises(RuntimeError, match="no room for the KV cache"):
        _size(tiny, CacheConfig(gpu_memory_utilization=0.1), CUDA, STARTUP)
    with pytest.raises(ValueError, match="measure_startup_memory"):
        _size(tiny, CacheConfig(), CUDA, None)


def test_engine_on_cpu_defaults_to_256_mib():
    engine = Engine(EngineConfig(model="tiny"))
    assert engine.cache_config.num_blocks == (256 * MiB) // (64 * 1024)
    assert engine.kv_cache.shape[0] == engine.cache_config.num_blocks


@pytest.mark.gpu
def test_engine_on_cuda_sizes_from_device_memory():
    free, total = torch.cuda.mem_get_info()
    util = min(0.5, 0.9 * free / total)
    engine = Engine(EngineConfig(model="tiny", device="cuda", cache=CacheConfig(gpu_memory_utilization=util)))
    block = bytes_per_block(engine.model_config, 16, engine.dtype)
    used = engine.cache_config.num_blocks * block
    assert used > 256 * MiB
    assert used <= util * total - headroom_bytes()
    (out,) = engine.generate([[1, 5, 6, 7]], None)
    assert len(out.output_token_ids) > 0
