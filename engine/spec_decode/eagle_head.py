"""An EAGLE-1 head (Li et al. 2024) for a Llama-shaped target, in the checkpoint layout vLLM loads.

The head predicts the target's next hidden state from the current one and the next token:
`x = fc([embed(t_{p+1}), h_p])` (`fc`: Linear 2H -> H), then the head's Llama decoder layers
(layer 0 without its `input_layernorm`: EAGLE removes it), and the residual added back, with no
final norm. The target's lm_head turns that into the next token's logits, and the target's
embedding embeds the tokens: both are the target's own modules, not the head's (vLLM shares
them the same way; a checkpoint's `embed_tokens` / `lm_head` tensors are not read).

Checkpoint (a directory): `config.json` is a Llama config (`architectures` `LlamaForCausalLM`
or `EagleLlamaForCausalLM`; or vLLM's older wrapper `{"model_type": "eagle", "model": {...}}`),
whose `hidden_size` and `vocab_size` must be the target's; `*.safetensors` holds `fc.weight`
(and `fc.bias`, which EAGLE's own training code has and vLLM drops: loaded when present) and
`layers.{i}.self_attn.{q,k,v,o}_proj`, `layers.{i}.post_attention_layernorm`,
`layers.{i}.mlp.{gate,up,down}_proj` (+ `layers.{i>0}.input_layernorm`), with or without the
`model.` prefix. A missing, extra or mis-shaped tensor is refused at startup, naming it.
`.bin` checkpoints (the EAGLE repo's) must be converted to safetensors first.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.kv_groups.spec import KVGroups
from engine.loader import CheckpointError, checkpoint_files, load_weights
from engine.model_config import ModelConfig, ModelConfigError
from engine.models.causal_lm import CausalLM
from engine.models.decoder import DecoderLayer
from engine.models.linear import Linear
from engine.models.mlp import MLP
from engine.rope import cos_sin_cache
from engine.spec_decode.config import SpeculativeConfigError

_ARCHITECTURES = ("LlamaForCausalLM", "EagleLlamaForCausalLM", "LlamaForCausalLMEagle")


class _NoInputNorm(nn.Module):
    """Layer 0's `input_layernorm` in an EAGLE head: none (the residual stream starts at fc's output)."""

    def forward(self, x: torch.Tensor, residual: None = None):
        return x, x             # layer 0 starts the residual stream (`EagleHead.forward` passes none)


class EagleHead(nn.Module):
    # Tensors the head does not load: the target's embedding and lm_head serve it, and vLLM drops
    # layer 0's input norm (EAGLE's training code deletes it).
    hf_renames: tuple[tuple[str, str], ...] = ()
    hf_ignored = (r"^embed_tokens\.", r"^lm_head\.", r"^layers\.0\.input_layernorm\.")

    def __init__(self, cfg: ModelConfig, fc_bias: bool, dtype: torch.dtype, device: torch.device,
                 max_position: int) -> None:
        super().__init__()
        self.cfg = cfg
        hidden = cfg.hidden_size
        self.fc = Linear(2 * hidden, hidden, bias=fc_bias, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, MLP(hidden, cfg.intermediate_size, dtype, device, None), dtype, device, None, i)
            for i in range(cfg.num_layers))
        self.layers[0].input_layernorm = _NoInputNorm()
        self.kv_groups = KVGroups.single(cfg.num_layers)   # its own cache, one group (the runner reads it)
        self.register_buffer("rope_cache", cos_sin_cache(cfg.rope, cfg.head_dim, max_position, device),
                             persistent=False)
        self.requires_grad_(False)

    # The loader's and the runner's hooks, as every family has them: every tensor as stored; CPU
    # oneDNN packing of the projections.
    checkpoint_tensors = CausalLM.checkpoint_tensors
    pack_weights = CausalLM.pack_weights

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """embeds: [T, H] (the target's embedding of token p + 1); hidden: [T, H] (the target's
        final hidden state at p, or the head's own output for a draft); positions: [T] (p).
        Returns the head's hidden states [T, H] (for the target's lm_head and the next draft)."""
        x = self.fc(torch.cat((embeds, hidden), dim=-1))                 # [T, H]
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rope_cache, kv_cache[:, i, 0], kv_cache[:, i, 1], meta)
        return x + residual


def _head_config(model_dir: Path) -> dict:
    file = model_dir / "config.json"
    if not file.is_file():
        raise SpeculativeConfigError(f"EAGLE head {model_dir}: no config.json")
    raw = json.loads(file.read_text())
    if raw.get("model_type") == "eagle" and isinstance(raw.get("model"), dict):   # vLLM's EAGLEConfig wrapper
        truncated = raw.get("truncated_vocab_size")
        raw = {**raw["model"]}
        if truncated is not None and truncated != raw.get("vocab_size"):
            raise SpeculativeConfigError(f"EAGLE head {model_dir}: truncated_vocab_size is not supported")
    if raw.get("add_para_norm"):
        raise SpeculativeConfigError(f"EAGLE head {model_dir}: add_para_norm (HASS heads) is not supported")
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    if not set(archs) <= set(_ARCHITECTURES):
        raise SpeculativeConfigError(f"EAGLE head {model_dir}: architectures {archs} is not a Llama EAGLE "
                                     f"head (one of {_ARCHITECTURES})")
    return {**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def load_eagle_head(model_dir: Path, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                    max_position: int) -> EagleHead:
    """The head at `model_dir`, checked against the target's config; errors name the key or tensor."""
    try:
        cfg = ModelConfig.from_dict(_head_config(model_dir))
    except (ModelConfigError, json.JSONDecodeError) as e:
        raise SpeculativeConfigError(f"EAGLE head {model_dir}: {e}") from None
    for key, head, ours in (("hidden_size", cfg.hidden_size, target.hidden_size),
                            ("vocab_size", cfg.vocab_size, target.vocab_size)):
        if head != ours:
            raise SpeculativeConfigError(f"EAGLE head {model_dir}: config.json {key} is {head}, the target's is "
                                         f"{ours}: the head reads the target's hidden states and tokens")
    try:
        files = checkpoint_files(model_dir)
        fc_bias = False
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                fc_bias |= any(name.removeprefix("model.") == "fc.bias" for name in f.keys())
        head = EagleHead(cfg, fc_bias, dtype, device, max_position)
        load_weights(head, model_dir)
    except CheckpointError as e:
        raise SpeculativeConfigError(f"EAGLE head: {e}") from None
    return head.eval()
