"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): routed experts plus a shared expert with a sigmoid gate.

A layer is MoE unless it is in `mlp_only_layers` or `(layer + 1) % decoder_sparse_step != 0`;
the others are dense MLPs of `intermediate_size` (`ModelConfig.is_moe_layer`). Experts are
`moe_intermediate_size` wide, the shared expert `shared_expert_intermediate_size`; top-k weights
are renormalized only with `norm_topk_prob`. Attention is Qwen2's (q/k/v bias by `qkv_bias`).
"""

from __future__ import annotations

from engine.models.causal_lm import CausalLM
from engine.models.moe import SparseMoE


class Qwen2MoeForCausalLM(CausalLM):
    def make_mlp(self, cfg, layer, dtype, device, comm):
        if cfg.is_moe_layer(layer):
            return SparseMoE(cfg, dtype, device, comm)
        return super().make_mlp(cfg, layer, dtype, device, comm)
