"""`--kv-cache-dtype fp8` in the engine (`engine/kv_dtype.py`): the cache, its size, its scales.

Stated bound: on `tiny`, the first step's logits with an fp8 KV cache stay within 6% relative
error (||a - b|| / ||b||) of the same engine with a float cache (measured 2.5%): prefill attention
reads the K/V it just wrote through the cache, so the step sees the quantization.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.kv_cache import bytes_per_block
from engine.kv_dtype import FP8_KV_DTYPE, kv_scales_suffix, resolve_kv_cache_dtype
from engine.sampling.params import SamplingParams
from kvtransfer.layout import KVLayout, check_compatible

SCHED = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8)
PROMPT = [1, 17, 200, 33, 90, 4, 250, 18, 77, 5, 61, 140, 9, 210, 35, 8, 99]


def _engine(kv_cache_dtype: str, **cache) -> Engine:
    return Engine(EngineConfig(model="tiny", scheduler=SCHED,
                               cache=CacheConfig(kv_cache_dtype=kv_cache_dtype, **cache)))


def _first_logits(engine: Engine) -> torch.Tensor:
    req = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=4))
    logits = engine.runner.run(engine.scheduler.schedule().scheduled).float().clone()
    engine.abort(req.request_id)
    return logits[0]


def test_fp8_cache_holds_one_byte_per_element_and_twice_the_tokens():
    memory = 4 << 20
    plain, fp8 = _engine("auto", kv_cache_memory_bytes=memory), _engine("fp8", kv_cache_memory_bytes=memory)
    assert plain.kv_cache.dtype == torch.float32 and fp8.kv_cache.dtype == FP8_KV_DTYPE
    cfg = fp8.model_config
    assert bytes_per_block(cfg, 16, FP8_KV_DTYPE) * 2 == bytes_per_block(cfg, 16, torch.bfloat16)
    # CPU engines run fp32: 4 bytes per element there against fp8's 1.
    assert fp8.cache_config.num_blocks == 4 * plain.cache_config.num_blocks
    assert fp8.kv_cache.numel() * fp8.kv_cache.element_size() <= memory


def test_fp8_cache_logits_stay_close_and_generation_runs():
    plain, fp8 = _engine("auto", num_blocks=64), _engine("fp8", num_blocks=64)
    ref, got = _first_logits(plain), _first_logits(fp8)
    assert 0 < float((got - ref).norm() / ref.norm()) <= 0.06
    out = fp8.generate([PROMPT, PROMPT[:5]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [len(o.output_token_ids) for o in out] == [8, 8]
    assert fp8.stats().num_free_blocks == plain.stats().num_free_blocks   # nothing leaked


def test_fp8_cache_changes_the_fingerprint_and_the_layout_dtype():
    plain, fp8 = _engine("auto", num_blocks=16), _engine("fp8", num_blocks=16)
    assert fp8.fingerprint == plain.fingerprint + kv_scales_suffix(fp8.model)
    fp8.model.layers[0].self_attn.kv_scales = (0.5, 1.0)          # other scales: another digest
    assert kv_scales_suffix(fp8.model) != kv_scales_suffix(plain.model)
    infos = [KVLayout.from_tensor(e.kv_cache).to_model_info("tiny", e.fingerprint) for e in (plain, fp8)]
    assert infos[1].kv_dtype == "float8_e4m3fn"
    assert KVLayout.from_model_info(infos[1]).bytes_per_block * 4 == KVLayout.from_model_info(infos[0]).bytes_per_block
    problem = check_compatible(infos[1], infos[0])
    assert "kv_dtype: 'float8_e4m3fn' here vs 'float32' there" in problem and "model_fingerprint" in problem


def test_resolve_kv_cache_dtype_refuses_what_it_cannot_serve(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) is torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32, cpu) is FP8_KV_DTYPE
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("int4", torch.float32, cpu)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="fp16")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability >= 8.9"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda")) is FP8_KV_DTYPE
