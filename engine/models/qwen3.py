"""Qwen3 (dense): the Llama layout plus a per-head RMSNorm of q and k before RoPE.

`self_attn.q_norm` / `k_norm` are `[head_dim]` weights shared by every head (engine/models/
attention.py applies them when `cfg.qk_norm`); `head_dim` is the config's (128 in the released
models, not `hidden_size / num_heads`); `attention_bias` puts biases on q/k/v and o.
"""

from __future__ import annotations

from engine.models.causal_lm import CausalLM


class Qwen3ForCausalLM(CausalLM):
    pass
