"""Qwen3-MoE (Qwen3-30B-A3B, -235B-A22B): Qwen3's attention (q/k norm) over routed experts.

No shared expert; `norm_topk_prob` is read from the config either way (the class default is
False, the released checkpoints set True); `decoder_sparse_step` / `mlp_only_layers` place dense
layers as in Qwen2-MoE.
"""

from __future__ import annotations

from engine.models.qwen2_moe import Qwen2MoeForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    pass
