"""Mixtral: every layer a mixture of experts (`num_local_experts`, top `num_experts_per_tok`).

Routing: softmax over the experts, top-k, always renormalized; the weights stay fp32. Its
checkpoints name the block `block_sparse_moe` and the experts' matrices `w1` (gate), `w3` (up),
`w2` (down); transformers 5's packed layout names them as Qwen-MoE does (`mlp.gate`,
`mlp.experts.gate_up_proj` / `down_proj`). Attention is Mistral's (GQA, no biases).
"""

from __future__ import annotations

from engine.models.causal_lm import CausalLM
from engine.models.moe import SparseMoE


class MixtralForCausalLM(CausalLM):
    hf_renames = (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    )

    def make_mlp(self, cfg, layer, dtype, device, comm):
        return SparseMoE(cfg, dtype, device, comm)
