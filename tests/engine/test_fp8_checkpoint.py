"""Hugging Face FP8 checkpoints (`engine/fp8_checkpoint.py`), written here from the `tiny` preset.

A per-channel FP8 checkpoint holds exactly what quantize-at-load computes from the same weights,
so the two engines must agree token for token (and logit for logit). A per-tensor checkpoint with
static activation scales and KV scales loads as stored; it is a different quantization, so it is
held to the float model by a bound instead. Unsupported layouts are refused by name.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.fp8 import FP8, FP8_MAX, Fp8Linear, quantize_weight_fp8
from engine.loader import CheckpointError
from engine.presets import resolve_model_dir
from engine.sampling.params import SamplingParams

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CACHE = CacheConfig(num_blocks=64)
SCHED = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8)


def _prompts(n: int = 3) -> list[list[int]]:
    rng = random.Random(7)
    return [[1] + [rng.randrange(3, 259) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def write_fp8_checkpoint(dst: Path, *, per_tensor: bool = False, static: bool = False,
                         kv_scales: tuple[float, float] | None = None, quantization_config: dict | None = None,
                         skip: tuple[str, ...] = ()) -> Path:
    """The tiny preset re-saved in the HF FP8 layout: projections (except names in `skip`) in
    float8_e4m3fn with `weight_scale` (per channel `[out, 1]`, or per tensor `[]`), `input_scale`
    when `static`, `self_attn.k_scale/v_scale` when `kv_scales`; everything else as stored."""
    src = resolve_model_dir("tiny")
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, dst / file.name)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    out = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if name.endswith(".weight") and parts[-2] in PROJECTIONS and not any(s in name for s in skip):
            base = name[: -len(".weight")]
            if per_tensor:
                scale = tensor.float().abs().max() / FP8_MAX
                out[name] = (tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
                out[base + ".weight_scale"] = scale.reshape(())
            else:
                weight, scale = quantize_weight_fp8(tensor)
                out[name], out[base + ".weight_scale"] = weight, scale[:, None].contiguous()
            if static:
                out[base + ".input_scale"] = torch.tensor(0.05 if parts[-2] != "down_proj" else 0.02)
        else:
            out[name] = tensor
    config = json.loads((src / "config.json").read_text())
    if kv_scales is not None:
        for i in range(config["num_hidden_layers"]):
            out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(kv_scales[0])
            out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(kv_scales[1])
    config["quantization_config"] = quantization_config or {
        "quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file(out, str(dst / "model.safetensors"))
    return dst


def _engine(model: str, **kwargs) -> Engine:
    return Engine(EngineConfig(model=model, cache=kwargs.pop("cache", CACHE), scheduler=SCHED, **kwargs))


def _first_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    req = engine.add_request(prompt, GREEDY)
    out = engine.scheduler.schedule()
    logits = engine.runner.run(out.scheduled).float().clone()
    engine.abort(req.request_id)
    return logits[0]


def test_per_channel_checkpoint_equals_quantize_at_load(tmp_path):
    path = write_fp8_checkpoint(tmp_path / "fp8")
    stored = _engine(str(path))
    at_load = _engine("tiny", quantization="fp8")
    assert stored.quantization == "fp8"                                  # implied by the checkpoint
    qkv = stored.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.weight.dtype == FP8
    for a, b in zip(stored.model.modules(), at_load.model.modules()):
        if isinstance(a, Fp8Linear):
            assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
            assert torch.equal(a.weight_scale, b.weight_scale)
    prompts = _prompts()
    assert ([o.output_token_ids for o in stored.generate(prompts, GREEDY)]
            == [o.output_token_ids for o in at_load.generate(prompts, GREEDY)])
    assert torch.equal(_first_logits(stored, prompts[0]), _first_logits(at_load, prompts[0]))


def test_per_tensor_static_checkpoint_with_kv_scales_loads_as_stored(tmp_path):
    path = write_fp8_checkpoint(tmp_path / "fp8", per_tensor=True, static=True, kv_scales=(0.5, 0.25))
    engine = _engine(str(path), cache=CacheConfig(num_blocks=64, kv_cache_dtype="fp8"))
    qkv = engine.model.layers[1].self_attn.qkv_proj
    assert qkv.input_scale is not None and float(qkv.input_scale) == pytest.approx(0.05)
    cfg = engine.model_config
    # Three per-tensor scales fused into one per-channel vector, each repeated over its part's rows.
    sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    for part in qkv.weight_scale.split(sizes):
        assert torch.equal(part, part[:1].expand_as(part))
    assert engine.model.layers[1].self_attn.kv_scales == (0.5, 0.25)
    assert engine.kv_cache.dtype == FP8
    assert not hasattr(engine.model.layers[1].self_attn, "k_scale")   # the temporary parameters are gone
    # Against the float model: the first step's logits stay close (per-tensor static weights and
    # activations plus an fp8 KV cache, 4 layers; measured 6.6-7.8%, quantize-at-load 7.7%).
    prompt = _prompts(1)[0]
    ref = _first_logits(_engine("tiny"), prompt)
    got = _first_logits(engine, prompt)
    assert float((got - ref).norm() / ref.norm()) <= 0.15


def test_fp8_checkpoint_refuses_other_quantizations_and_layouts(tmp_path):
    path = write_fp8_checkpoint(tmp_path / "fp8")
    with pytest.raises(ValueError, match="--quantization int8 cannot apply"):
        _engine(str(path), quantization="int8")
    cases = {
        "block": dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
        "gptq": dict(quantization_config={"quant_method": "gptq", "bits": 4}),
        "e5m2": dict(quantization_config={"quant_method": "fp8", "fmt": "e5m2"}),
        "scheme": dict(quantization_config={"quant_method": "fp8", "activation_scheme": "weird"}),
        "mixed": dict(skip=("layers.0.self_attn.k_proj",)),
    }
    messages = {"block": "block-wise FP8", "gptq": "'gptq' is not supported", "e5m2": "only e4m3",
                "scheme": "activation_scheme must be one of", "mixed": "must be quantized as a whole"}
    for name, kwargs in cases.items():
        bad = write_fp8_checkpoint(tmp_path / name, **kwargs)
        with pytest.raises(CheckpointError, match=messages[name]):
            _engine(str(bad))


def test_static_checkpoint_needs_its_input_scales(tmp_path):
    path = write_fp8_checkpoint(tmp_path / "fp8", static=True)
    (path / "model.safetensors").rename(tmp_path / "full.safetensors")
    tensors = load_file(str(tmp_path / "full.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.input_scale"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors for: layers.2.mlp.gate_up_proj.input_scale"):
        _engine(str(path))
