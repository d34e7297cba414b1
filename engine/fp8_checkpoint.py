"""Checkpoints stored in FP8: the common Hugging Face layout, loaded as they are (no requantizing).

The layout (AutoFP8 / llm-compressor, vLLM's `fp8` method): config.json has
`quantization_config: {"quant_method": "fp8", "activation_scheme": "dynamic" | "static"}`; each
quantized projection has `weight` in float8_e4m3fn and `weight_scale` (fp32: one per tensor, `[]`
or `[1]`, or one per output channel, `[out]` or `[out, 1]`); with the static scheme also
`input_scale` (`[]`); optionally `self_attn.k_scale` / `self_attn.v_scale` for an fp8 KV cache.
Projections stored in another dtype (the lm_head, layers the quantizer ignored) stay float.

Which projections are FP8 is read from the safetensors headers (the stored dtype), not from the
config's `ignore` list: the header cannot disagree with the bytes. The model is built as usual,
then each FP8 projection becomes an empty `Fp8Linear` whose parameters carry a `weight_loader`
(engine/loader.py calls it) that places the fused parts: a per-tensor scale is repeated over its
part's rows, so q/k/v with three different scales fuse without requantizing. Fused static
`input_scale`s (q/k/v share one input) keep the largest, so no part saturates sooner than it would
alone. Unsupported variants are refused by name: block-wise scales (`weight_block_size`), e5m2,
other quantization methods, a fused projection whose parts are not all FP8.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.fp8 import FP8, Fp8Linear
from engine.loader import CheckpointError, build_model, checkpoint_files, load_weights
from engine.model_config import ModelConfig
from engine.models.causal_lm import CausalLM
from engine.models.weights import FUSED, map_name, num_parts, part_sizes

log = logging.getLogger(__name__)

ACTIVATION_SCHEMES = ("dynamic", "static")
KV_SCALE_NAMES = ("k_scale", "v_scale")


@dataclass(frozen=True)
class Fp8CheckpointConfig:
    """config.json's `quantization_config` for an FP8 checkpoint."""

    activation_scheme: str = "dynamic"

    def __post_init__(self) -> None:
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise CheckpointError(f"quantization_config.activation_scheme must be one of {ACTIVATION_SCHEMES}, "
                                  f"got {self.activation_scheme!r}")


def read_fp8_config(path: Path) -> Fp8CheckpointConfig | None:
    """The checkpoint's FP8 quantization config; None for an unquantized checkpoint.

    Raises `CheckpointError` for a quantization cbserve cannot load (another method, block-wise
    scales, e5m2)."""
    config = json.loads((path / "config.json").read_text())
    qcfg = config.get("quantization_config")
    if not qcfg:
        return None
    method = qcfg.get("quant_method")
    if method == "mxfp4" and config.get("model_type") == "gpt_oss":
        return None   # its MXFP4 experts are dequantized at load (engine/models/gpt_oss.py)
    if method != "fp8":
        raise CheckpointError(f"{path}: quantization_config.quant_method {method!r} is not supported; cbserve "
                              "loads unquantized checkpoints and 'fp8' ones (e4m3 weights, per-tensor or "
                              "per-channel scales)")
    if qcfg.get("weight_block_size"):
        raise CheckpointError(f"{path}: block-wise FP8 scales (weight_block_size={qcfg['weight_block_size']}) are "
                              "not supported; only per-tensor or per-channel weight scales")
    fmt = qcfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{path}: FP8 format {fmt!r} is not supported; only e4m3 (float8_e4m3fn)")
    return Fp8CheckpointConfig(qcfg.get("activation_scheme", "dynamic"))


def resolve_quantization(requested: str | None, fp8: Fp8CheckpointConfig | None) -> str | None:
    """The engine's quantization: an FP8 checkpoint is `fp8` whether or not the flag says so (its
    weights are stored that way); asking it for another quantization is refused."""
    if fp8 is None:
        return requested
    if requested not in (None, "fp8"):
        raise ValueError(f"the checkpoint is stored in FP8 (quantization_config.quant_method 'fp8'): "
                         f"--quantization {requested} cannot apply to it; leave the flag out or pass fp8")
    if requested is None:
        log.info("the checkpoint is stored in FP8: serving it with --quantization fp8")
    return "fp8"


def _stored_dtypes(path: Path) -> dict[str, str]:
    """HF tensor name -> safetensors dtype string ("F8_E4M3", "BF16", ...), from the headers only."""
    dtypes = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                dtypes[name] = f.get_slice(name).get_dtype()
    return dtypes


def _module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0]


def _rows(cfg: ModelConfig, param_name: str, index: int | None, out_features: int) -> tuple[int, int]:
    """(first row, row count) of fused part `index` in the module's output channels."""
    if index is None:
        return 0, out_features
    sizes = part_sizes(cfg, param_name, out_features)
    return sum(sizes[:index]), sizes[index]


def _attach_loaders(layer: Fp8Linear, module_name: str, cfg: ModelConfig) -> None:
    """Give the layer's parameters their `weight_loader`s (see the module docstring)."""

    def load_weight(tensor: torch.Tensor, index: int | None, hf_name: str) -> None:
        start, rows = _rows(cfg, module_name + ".weight", index, layer.out_features)
        dest = layer.weight.data.narrow(0, start, rows)
        if tensor.dtype != FP8:
            raise CheckpointError(f"tensor {hf_name!r} is {tensor.dtype}; the other parts of {module_name} are "
                                  f"{FP8}: a fused projection must be quantized as a whole")
        if tuple(tensor.shape) != tuple(dest.shape):
            raise CheckpointError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, config expects "
                                  f"{tuple(dest.shape)}")
        dest.copy_(tensor)

    def load_weight_scale(tensor: torch.Tensor, index: int | None, hf_name: str) -> None:
        start, rows = _rows(cfg, module_name + ".weight_scale", index, layer.out_features)
        dest = layer.weight_scale.data.narrow(0, start, rows)
        scale = tensor.float()
        if scale.numel() == 1:                                   # per tensor: [] or [1]
            dest.fill_(scale.item())
        elif tuple(scale.shape) in ((rows,), (rows, 1)):         # per output channel
            dest.copy_(scale.reshape(rows))
        else:
            raise CheckpointError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}: expected a per-tensor "
                                  f"scale ([] or [1]) or per-channel ([{rows}] or [{rows}, 1]); block-wise "
                                  f"scales are not supported")
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise CheckpointError(f"tensor {hf_name!r} holds a scale that is not finite and positive")

    def load_input_scale(tensor: torch.Tensor, index: int | None, hf_name: str) -> None:
        if tensor.numel() != 1:
            raise CheckpointError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}: static input scales "
                                  "are per tensor ([] or [1])")
        value = float(tensor.float().reshape(()))
        if not value > 0 or value == float("inf"):
            raise CheckpointError(f"tensor {hf_name!r} = {value} is not a finite positive scale")
        layer.input_scale.data.fill_(max(value, float(layer.input_scale)))

    layer.weight.weight_loader = load_weight
    layer.weight_scale.weight_loader = load_weight_scale
    if layer.input_scale is not None:
        layer.input_scale.data.zero_()      # the running max over the fused parts starts at 0
        layer.input_scale.weight_loader = load_input_scale


def _register_kv_scales(model: CausalLM, names: set[str]) -> dict[str, float]:
    """Temporary parameters for the checkpoint's `self_attn.k_scale` / `v_scale` tensors; their
    loaders record the values in the returned dict (our parameter name -> scale)."""
    found: dict[str, float] = {}
    for name in names:
        module_name, attr = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        param = nn.Parameter(torch.ones(()), requires_grad=False)

        def load(tensor: torch.Tensor, index: int | None, hf_name: str, name: str = name) -> None:
            if tensor.numel() != 1:
                raise CheckpointError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}: KV scales are per "
                                      "tensor ([] or [1])")
            value = float(tensor.float().reshape(()))
            if not 0 < value < float("inf"):
                raise CheckpointError(f"tensor {hf_name!r} = {value} is not a finite positive scale")
            found[name] = value

        param.weight_loader = load
        module.register_parameter(attr, param)
    return found


def load_fp8_model(path: Path, cfg: ModelConfig, fp8: Fp8CheckpointConfig, dtype: torch.dtype,
                   device: torch.device, max_position: int | None = None) -> CausalLM:
    """Build the model and load an FP8 checkpoint into it as stored (see the module docstring).

    Each attention module's `kv_scales` is set from the checkpoint's k_scale / v_scale (else it
    stays (1.0, 1.0)); they matter only with `--kv-cache-dtype fp8`."""
    if cfg.num_experts:
        raise CheckpointError(f"{path}: FP8 checkpoints of mixture-of-experts models ({cfg.architecture}) are not "
                              "supported: serve the bf16 checkpoint (with --quantization fp8 to quantize it at load)")
    dtypes = _stored_dtypes(path)
    bad = sorted(n for n, d in dtypes.items() if d.startswith("F8") and d != "F8_E4M3")
    if bad:
        raise CheckpointError(f"tensors {bad[:3]} are {dtypes[bad[0]]}; only F8_E4M3 (float8_e4m3fn) is supported")
    model = build_model(cfg, dtype, device, max_position)
    parts: dict[str, set[int | None]] = {}
    kv_scale_names: set[str] = set()
    for hf_name, stored in dtypes.items():
        target = map_name(hf_name, cfg, model.hf_renames, model.hf_ignored)
        if target is None:
            continue
        ours, index = target.param, target.part
        if stored == "F8_E4M3" and ours.endswith(".weight"):
            parts.setdefault(_module_of(ours), set()).add(index)
        elif ours.rsplit(".", 1)[-1] in KV_SCALE_NAMES and ".self_attn." in ours:
            kv_scale_names.add(ours)
    if not parts:
        raise CheckpointError(f"{path}: quantization_config says fp8 but no weight is stored as F8_E4M3")

    static = fp8.activation_scheme == "static"
    for module_name, indices in sorted(parts.items()):
        expected = num_parts(module_name + ".weight")
        if len(indices) != expected:
            fused = [hf for hf, (ours, _) in FUSED.items() if module_name.endswith(ours)]
            raise CheckpointError(f"only some of {fused} are stored in FP8 for {module_name}: a fused projection "
                                  "must be quantized as a whole")
        old = model.get_submodule(module_name)
        layer = Fp8Linear(old.in_features, old.out_features, old.bias is not None, dtype, device, static)
        _attach_loaders(layer, module_name, cfg)
        parent_name, attr = module_name.rsplit(".", 1) if "." in module_name else ("", module_name)
        setattr(model.get_submodule(parent_name), attr, layer)
    kv_scales = _register_kv_scales(model, kv_scale_names)
    load_weights(model, path)
    for name in kv_scale_names:                       # the temporary parameters go again
        module_name, attr = name.rsplit(".", 1)
        delattr(model.get_submodule(module_name), attr)
    for i, layer in enumerate(model.layers):
        prefix = f"layers.{i}.self_attn."
        layer.self_attn.kv_scales = (kv_scales.get(prefix + "k_scale", 1.0), kv_scales.get(prefix + "v_scale", 1.0))
    for module in model.modules():                    # loaders close over their layer: drop them
        for param in module.parameters(recurse=False):
            param.__dict__.pop("weight_loader", None)
    log.info("FP8 checkpoint: %d projections in e4m3 (%s activations), %d KV scales", len(parts),
             fp8.activation_scheme, len(kv_scales))
    return model.eval()
