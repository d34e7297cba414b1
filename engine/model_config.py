"""The model's shape, read from a Hugging Face `config.json` (transformers 4.x and 5.x layouts).

The families of engine/models/registry.py: Llama 2/3, Mistral, Qwen2, Qwen3 (dense decoders with
RMSNorm, RoPE, GQA, SwiGLU, optional q/k/v bias, q/k norm and tied embeddings) and the mixtures
of experts Mixtral, Qwen2-MoE and Qwen3-MoE. Anything else is refused here, at the boundary, with
a message that names the field. A field missing from config.json takes the transformers config
class's default for that family (`_family_fields`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.models.registry import ARCHITECTURES, family_of

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Families whose `sliding_window` applies to every layer (transformers ignores `layer_types` there).
_WINDOW_IN_EVERY_LAYER = ("mistral", "mixtral")
# MLP activations by their transformers names: SwiGLU (silu) or GeGLU with tanh-approximate GELU.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
DTYPES = ("float32", "float16", "bfloat16")


class ModelConfigError(ValueError):
    """A config.json that cbserve cannot serve, with the reason."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (gpt-oss): the correction range and cos/sin's attention factor (None: from `factor`).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    # Per-layer sliding windows (a query sees its last `window` keys; 0: full attention), from
    # `layer_types` / the family's pattern; () when every layer is full (engine/models/attention.py).
    layer_windows: tuple[int, ...] = ()
    local_rope: RopeConfig | None = None   # RoPE of the sliding layers, if its own (Gemma 3's local base)
    query_pre_attn_scalar: float | None = None   # softmax scale = this ** -0.5 (Gemma); None: head_dim
    final_logit_softcapping: float | None = None   # logits = cap * tanh(logits / cap) (Gemma)
    hidden_act: str = "silu"            # the dense MLP's gate activation (ACTIVATIONS)
    attention_sinks: bool = False       # one learned logit per head in the softmax denominator (gpt-oss)
    qk_norm: bool = False               # per-head RMSNorm of q and k before RoPE (Qwen3)
    # Mixture of experts (num_experts 0: every layer dense). A layer is MoE when it is not in
    # `mlp_only_layers` and (layer + 1) % decoder_sparse_step == 0 (Qwen2-MoE's rule; 1: all).
    num_experts: int = 0
    num_experts_per_tok: int = 0        # top-k
    moe_intermediate_size: int = 0      # each expert's intermediate size
    norm_topk_prob: bool = False        # renormalize the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE's always-on expert (0: none)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # transformers rounds the routing weights to the model dtype before use (Qwen-MoE) or keeps
    # them in fp32 (Mixtral); only half-precision results differ.
    round_router_weights: bool = False
    # gpt-oss: router and experts carry biases, and the experts gate with its clamped SwiGLU
    # ("swiglu_oai": (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)).
    moe_bias: bool = False
    moe_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"config field {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ModelConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                                       f"[1, num_experts ({self.num_experts})]")
            if self.moe_intermediate_size < 1:
                raise ModelConfigError(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
            if self.decoder_sparse_step < 1:
                raise ModelConfigError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if self.torch_dtype not in DTYPES:
            raise ModelConfigError(f"torch_dtype must be one of {DTYPES}, got {self.torch_dtype!r}")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise ModelConfigError(f"layer_windows must give each of the {self.num_layers} layers a window >= 0 "
                                   f"(0: full attention), got {self.layer_windows}")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelConfigError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) is a mixture of experts (else a dense MLP)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def num_dense_layers(self) -> int:
        return sum(not self.is_moe_layer(i) for i in range(self.num_layers))

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def kv_free_window(self) -> int | None:
        """The window behind which no layer reads a token, when every layer has one: the KV
        cache frees whole blocks behind it (a block holds every layer's KV). None when some layer
        attends to everything (Gemma 3's and gpt-oss's full layers): then nothing is freed early."""
        if self.layer_windows and min(self.layer_windows) > 0:
            return max(self.layer_windows)
        return None

    @property
    def max_model_len(self) -> int:
        """Longest context served (the kernels run sliding windows, so a window caps nothing)."""
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        family = family_of(archs, raw.get("model_type"))
        if family is None:
            raise ModelConfigError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; cbserve serves "
                f"{sorted(ARCHITECTURES)}")
        if isinstance(raw.get("text_config"), dict):   # a multimodal checkpoint: serve its text model
            top = {k: raw[k] for k in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype") if k in raw}
            raw = {**top, **raw["text_config"]}
        try:
            hidden = int(raw["hidden_size"])
            num_heads = int(raw["num_attention_heads"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            if raw.get("mlp_bias"):
                raise ModelConfigError("mlp_bias=true is not supported")
            hidden_act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
            if hidden_act not in ACTIVATIONS:
                raise ModelConfigError(f"hidden_act must be one of {ACTIVATIONS}, got {hidden_act!r}")
            sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
            num_layers = int(raw["num_hidden_layers"])
            extras = _attention_extras(raw, family)
            return cls(
                architecture=family,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or (128 if family == "qwen3" else hidden // num_heads)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=extras.pop("rope") if "rope" in extras else _parse_rope(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                sliding_window=int(sliding) if sliding else None,
                layer_windows=_layer_windows(raw, family, num_layers, int(sliding) if sliding else 0),
                hidden_act=hidden_act,
                **_family_fields(family, raw),
                **extras,
            )
        except KeyError as e:
            raise ModelConfigError(f"config.json is missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ModelConfigError):
                raise
            raise ModelConfigError(f"bad value in config.json: {e}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ModelConfigError(f"no config.json in {path}")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{file} is not valid JSON: {e}") from None
        return cls.from_dict(raw)


def _family_fields(family: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The fields in which the families differ: attention biases, q/k norm, experts and routing."""
    attention_bias = bool(raw.get("attention_bias", False))
    fields: dict[str, Any] = dict(qkv_bias=attention_bias, o_bias=attention_bias)
    if family == "qwen2":                  # q/k/v bias always, none on o_proj
        fields.update(qkv_bias=True, o_bias=False)
    if family in ("qwen3", "qwen3_moe"):
        fields.update(qk_norm=True)
    if family == "mixtral":                # every layer MoE, softmax -> top-k -> renormalized
        fields.update(num_experts=int(raw.get("num_local_experts", 8)),
                      num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
                      moe_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True)
    if family in ("qwen2_moe", "qwen3_moe"):
        # Qwen3-MoE's config maps num_experts to num_local_experts (attribute_map): it saves either.
        experts = raw.get("num_experts", raw.get("num_local_experts", 60 if family == "qwen2_moe" else 128))
        fields.update(num_experts=int(experts),
                      num_experts_per_tok=int(raw.get("num_experts_per_tok", 4 if family == "qwen2_moe" else 8)),
                      moe_intermediate_size=int(raw.get("moe_intermediate_size",
                                                        1408 if family == "qwen2_moe" else 768)),
                      norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                      decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
                      mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
                      round_router_weights=True)
    if family == "gpt_oss":                # top-k over the router's logits, softmax over the k (= renormalized)
        fields.update(num_experts=int(raw.get("num_local_experts", 128)),
                      num_experts_per_tok=int(raw.get("num_experts_per_tok", 4)),
                      moe_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True,
                      round_router_weights=True, moe_bias=True, moe_activation="swiglu_oai",
                      swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                      swiglu_limit=float(raw.get("swiglu_limit", 7.0)))
    if family == "qwen2_moe":              # q/k/v bias by its own flag; a shared expert with a sigmoid gate
        fields.update(qkv_bias=bool(raw.get("qkv_bias", True)), o_bias=False,
                      shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size", 5632)))
    return fields


def _parse_rope(raw: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); 4.x writes `rope_theta`
    # and an optional `rope_scaling` whose type key is `rope_type` or the older `type`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if params.get("attention_factor") is None else float(params["attention_factor"]),
    )


def _layer_windows(raw: dict[str, Any], family: str, num_layers: int, window: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full) as transformers assigns them: Mistral and Mixtral
    window every layer; others follow `layer_types`, else their pattern (Qwen's layers from
    `max_window_layers` on; Gemma 3's every `sliding_window_pattern`-th layer full; gpt-oss's odd
    layers full). () when no layer has a window."""
    if not window:
        return ()
    if family in _WINDOW_IN_EVERY_LAYER:
        return (window,) * num_layers
    types = raw.get("layer_types")
    if types is None:
        if family == "gemma3":
            pattern = int(raw.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        elif family == "gpt_oss":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        else:   # Qwen2/Qwen3 (and their MoE): windows from max_window_layers on
            first = int(raw.get("max_window_layers", num_layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ModelConfigError(f"layer_types must name each of the {num_layers} layers one of {LAYER_TYPES}, "
                               f"got {types!r}")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _attention_extras(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """The attention fields only some families set: Gemma 3's query scale, local RoPE and logit
    softcap, gpt-oss's sinks. Refuses what transformers would compute and cbserve would not."""
    if family == "gpt_oss":
        return dict(attention_sinks=True)
    if family != "gemma3":
        return {}
    if raw.get("use_bidirectional_attention"):
        raise ModelConfigError("use_bidirectional_attention=true (Gemma embedding models) is not supported")
    # transformers 5: rope_parameters per layer type; 4.x: rope_theta (+ rope_scaling) for the full
    # layers and rope_local_base_freq for the sliding ones.
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        rope = _parse_rope({"rope_parameters": params.get("full_attention") or {}}, 1_000_000.0)
        local = _parse_rope({"rope_parameters": params.get("sliding_attention") or {}})
    else:
        rope = _parse_rope(raw, 1_000_000.0)
        local = RopeConfig(theta=float(raw.get("rope_local_base_freq", 10000.0)))
    cap = raw.get("final_logit_softcapping")
    # attn_logit_softcapping is ignored, as transformers' Gemma 3 attention does.
    return dict(rope=rope, local_rope=local, query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
                final_logit_softcapping=float(cap) if cap else None)
