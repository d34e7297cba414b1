"""Reading a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) and checking
that it fits the base model.

PEFT saves `base_model.model.<HF module>.lora_A.weight` `[r, in]` and `.lora_B.weight` `[out, r]`
for every targeted projection, and computes `W x + s * B (A x)` with `s = lora_alpha / r`
(`lora_alpha / sqrt(r)` with `use_rslora`). The HF module names map onto our fused parameters
the way checkpoint names do (`engine.models.weights.map_name`): `q_proj`/`k_proj`/`v_proj` are
parts 0/1/2 of `qkv_proj`, `gate_proj`/`up_proj` parts 0/1 of `gate_up_proj`; an adapter of a
fused checkpoint module (Phi-3's `qkv_proj`) covers every part. The targets are read from the
tensors present, so `target_modules` regexes, `all-linear` and `layers_to_transform` need no
interpretation.

Refused with a `LoRAAdapterError` naming the reason (the server answers 400, never crashes):
a rank above `--max-lora-rank`, tensors whose shapes do not fit the base model, modules cbserve
does not apply LoRA to (embeddings, the head, routers, the experts of a mixture of experts), and
PEFT options that change the math (DoRA, LoRA biases, `modules_to_save`, rank/alpha patterns, ...).

`AdapterWeights.identity` is the adapter's server-side identity: a SHA-256 of both files. It keys the
prefix cache (KV computed under one adapter is wrong for another, whatever the client calls it)
and is checked between prefill and decode pods.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from engine.lora.errors import LoRAAdapterError
from engine.model_config import ModelConfig
from engine.models.weights import map_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
# PEFT options that change what the adapter computes: each must be unset (null, false or empty).
_UNSUPPORTED = ("use_dora", "lora_bias", "fan_in_fan_out", "use_qalora", "modules_to_save", "rank_pattern",
                "alpha_pattern", "layer_replication", "trainable_token_indices", "alora_invocation_tokens",
                "target_parameters", "use_bdlora")


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass
class AdapterWeights:
    """An adapter's tensors in the base model's (global, unsharded) shapes, fp32, on the CPU."""

    identity: str                      # server-side identity: hash of the two files' bytes
    config: AdapterConfig
    # our module path ("layers.0.self_attn.qkv_proj") -> part (None: the whole fused module) -> (A, B)
    modules: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor]]]
    target_modules: tuple[str, ...]    # HF module names targeted, for messages ("q_proj", "down_proj")


def adapter_files(path: str | Path) -> tuple[Path, Path]:
    path = Path(path)
    config, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter path {str(path)!r} is not a directory")
    if not config.is_file():
        raise LoRAAdapterError(f"no {ADAPTER_CONFIG} in LoRA adapter directory {str(path)!r}")
    if not weights.is_file():
        extra = " (adapter_model.bin is not read: convert it to safetensors)" if (path / "adapter_model.bin").is_file() \
            else ""
        raise LoRAAdapterError(f"no {ADAPTER_WEIGHTS} in LoRA adapter directory {str(path)!r}{extra}")
    return config, weights


def _identity(config_bytes: bytes, weights_bytes: bytes) -> str:
    """SHA-256 (hex, 32 characters) of the adapter's two files, as read."""
    digest = hashlib.sha256()
    for name, data in ((ADAPTER_CONFIG, config_bytes), (ADAPTER_WEIGHTS, weights_bytes)):
        digest.update(f"{name}:{len(data)}:".encode())
        digest.update(data)
    return digest.hexdigest()[:32]


def parse_adapter_config(raw: object, where: str, max_rank: int) -> AdapterConfig:
    if not isinstance(raw, dict):
        raise LoRAAdapterError(f"{where}: expected a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {raw.get('peft_type')!r} is not LORA")
    if raw.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{where}: bias={raw['bias']!r} is not supported (only 'none')")
    for key in _UNSUPPORTED:
        if raw.get(key) not in (None, False, [], {}, ""):
            raise LoRAAdapterError(f"{where}: {key}={raw[key]!r} is not supported")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA adapter rank {rank} exceeds --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora", False)))


def read_adapter(path: str | Path, targets: Mapping[str, "LoRATarget"], model_cfg: ModelConfig,  # noqa: F821
                 renames: tuple[tuple[str, str], ...], max_rank: int) -> AdapterWeights:
    """The adapter at `path`, checked against the base model's LoRA targets (engine/lora/layers.py:
    module path -> the global shapes of its parts); raises `LoRAAdapterError`. Each file is read
    once, and the identity is the hash of exactly the bytes parsed."""
    config_file, weights_file = adapter_files(path)
    try:
        config_bytes, weights_bytes = config_file.read_bytes(), weights_file.read_bytes()
    except OSError as e:
        raise LoRAAdapterError(f"cannot read LoRA adapter {str(path)!r}: {e.strerror or e}") from None
    try:
        raw = json.loads(config_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{config_file}: not a JSON file ({e})") from None
    config = parse_adapter_config(raw, str(config_file), max_rank)
    try:
        tensors = load_safetensors(weights_bytes)
    except Exception as e:  # noqa: BLE001 - a corrupt file is the adapter's fault: a 400, not a crash
        raise LoRAAdapterError(f"{weights_file}: unreadable safetensors file ({e})") from None
    halves: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
    hf_modules: dict[tuple[str, int | None], str] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(f"{weights_file.name}: tensor {key!r} is not a LoRA A/B weight "
                                   "(embedding and head adapters are not supported)")
        hf_module = match["module"].removeprefix(_PEFT_PREFIX)
        place = _place(hf_module, targets, model_cfg, renames)
        if not tensor.is_floating_point():
            raise LoRAAdapterError(f"{key}: {tensor.dtype} is not a floating-point weight")
        halves.setdefault(place, {})[match["ab"]] = tensor.float()
        hf_modules[place] = hf_module
    if not halves:
        raise LoRAAdapterError(f"{weights_file.name} holds no LoRA weights")
    modules: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (module, part), pair in halves.items():
        name = hf_modules[(module, part)]
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"{name}: lora_{'B' if 'A' in pair else 'A'} is missing")
        a, b = pair["A"], pair["B"]
        out_features, in_features = targets[module].global_shape(part)
        if tuple(a.shape) != (config.rank, in_features) or tuple(b.shape) != (out_features, config.rank):
            raise LoRAAdapterError(
                f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base model, which "
                f"needs [{config.rank}, {in_features}] / [{out_features}, {config.rank}] (r={config.rank})")
        modules.setdefault(module, {})[part] = (a, b)
    for module, parts in modules.items():
        if None in parts and len(parts) > 1:
            raise LoRAAdapterError(f"{module}: both the fused module and its parts are adapted")
    targeted = tuple(sorted({m.rpartition(".")[2] for m in hf_modules.values()}))
    return AdapterWeights(_identity(config_bytes, weights_bytes), config, modules, targeted)


def _place(hf_module: str, targets: Mapping, model_cfg: ModelConfig,
           renames: tuple[tuple[str, str], ...]) -> tuple[str, int | None]:
    """(our module path, part) a targeted HF module's adapter applies to."""
    target = map_name(f"{hf_module}.weight", model_cfg, renames)
    if target is not None and target.expert is not None:
        raise LoRAAdapterError(f"LoRA on the experts of a mixture of experts ({hf_module}) is not supported: "
                               "target the attention projections (q/k/v/o_proj) or dense MLPs only")
    module = None if target is None else target.param.removesuffix(".weight")
    if module not in targets:
        leaf = hf_module.rpartition(".")[2]
        raise LoRAAdapterError(f"LoRA target {hf_module} ({leaf}) is not supported on this model: cbserve applies "
                               "LoRA to q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj and down_proj of "
                               "attention and dense MLP layers")
    return module, target.part
