"""Llama 2/3, Mistral and Qwen2: the shared shell as it is (dense SwiGLU MLP in every layer).

What tells them apart is all in the config (engine/model_config.py): Qwen2's q/k/v bias,
Llama's optional `attention_bias` (q/k/v and o), rope scaling, tied embeddings, GQA. Their
checkpoints use the shared names (`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`).
"""

from __future__ import annotations

from engine.models.causal_lm import CausalLM


class LlamaForCausalLM(CausalLM):
    pass
