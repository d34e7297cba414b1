"""Mixture-of-experts feed-forward: a top-k router over SwiGLU experts, optionally a shared expert.

Routing runs on the device and reads nothing back: `softmax(router_logits)` in fp32, `topk`,
renormalized to sum to 1 when the family says so (Mixtral always, Qwen-MoE by `norm_topk_prob`),
rounded to the model dtype where transformers rounds them (Qwen-MoE). The experts run in one
`kernels.fused_moe` call: Triton's grouped GEMM on CUDA (CUDA-graph safe), on CPU the reference
loop over the experts that got tokens, on oneDNN-packed per-expert weights once `pack()` ran.

Qwen2-MoE adds a shared expert, a dense MLP every token goes through, scaled by
`sigmoid(shared_expert_gate(x))`. gpt-oss (`cfg.moe_bias`): the router and every expert's two
projections carry biases, and the experts gate with its clamped SwiGLU (`cfg.moe_activation`);
under tensor parallelism only rank 0 holds the down projection's bias (the all-reduce adds it once). Tensor parallelism: every rank holds a slice of every expert's
intermediate dim (and of the shared expert's), the routers whole; the block's partial sums meet
in one all-reduce, as a dense MLP's do.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.model_config import ModelConfig
from engine.models.linear import Linear, linear, pack_weight
from engine.models.mlp import MLP
from kernels.moe_ref import fused_moe_ref


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          round_to: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, E]` logits -> (`[T, K]` fp32 weights, `[T, K]` int64 expert ids), on the device."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_to is not None:
        weights = weights.to(round_to).float()
    return weights, ids


class Experts(nn.Module):
    """`gate_up_proj [E, 2I, H]` (each expert's gate rows, then up rows) and `down_proj [E, H, I]`,
    transformers 5's layout; `I` is this rank's share. fp8 (`--quantization fp8`, engine/fp8.py):
    e4m3 weights with `gate_up_scale [E, 2I]` / `down_scale [E, H]` per output channel."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device, bias: bool = False, activation: str = "silu",
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> None:
        """`bias`: `gate_up_proj_bias [E, 2I]` and `down_proj_bias [E, H]` (gpt-oss); `activation`:
        "silu" or gpt-oss's "swiglu_oai" with its alpha and limit."""
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros((num_experts, 2 * intermediate, hidden), dtype=dtype,
                                                     device=device), requires_grad=False)
        self.down_proj = nn.Parameter(torch.zeros((num_experts, hidden, intermediate), dtype=dtype, device=device),
                                      requires_grad=False)
        self.register_buffer("gate_up_scale", None)     # [E, 2I] fp32, fp8 weights only
        self.register_buffer("down_scale", None)        # [E, H] fp32
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros((num_experts, 2 * intermediate), dtype=dtype,
                                                              device=device), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.zeros((num_experts, hidden), dtype=dtype, device=device),
                                               requires_grad=False)
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.options = dict(activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None   # CPU, after pack()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; weights, ids: [T, K] -> [T, H]
        extras = dict(w13_bias=self.gate_up_proj_bias, w2_bias=self.down_proj_bias, **self.options)
        if self.packed is not None:
            return fused_moe_ref(x, *self.packed, weights, ids, linear=linear, **extras)
        return kernels.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, self.gate_up_scale,
                                 self.down_scale, **extras)

    def pack(self) -> bool:
        """CPU: reorder every expert's two matrices into oneDNN's layout, in place of the 3-D
        parameters (freed once all are packed: the peak holds both copies once); False where
        they cannot be packed (see `linear.pack_weight`; fp8 experts stay as they are)."""
        if self.packed is not None:
            return True
        first = None if self.gate_up_scale is not None else pack_weight(self.gate_up_proj[0])
        if first is None:
            return False
        packed = ([first, *(pack_weight(w) for w in self.gate_up_proj[1:])],
                  [pack_weight(w) for w in self.down_proj])
        del self.gate_up_proj, self.down_proj
        for kind, tensors in zip(("gate_up_proj", "down_proj"), packed):
            for e, t in enumerate(tensors):          # buffers, so the weights count as the model's memory
                self.register_buffer(f"{kind}_{e}", t, persistent=False)
        self.packed = packed
        return True


class SparseMoE(nn.Module):
    """The MoE block of one decoder layer: `[T, hidden] -> [T, hidden]`."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, comm=None) -> None:
        """`cfg`: this rank's config (its share of each expert's intermediate size)."""
        super().__init__()
        self.comm = comm
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.round_to = dtype if cfg.round_router_weights else None
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.moe_bias, dtype=dtype, device=device)  # router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, device,
                               cfg.moe_bias, cfg.moe_activation, cfg.swiglu_alpha, cfg.swiglu_limit)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype, device)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False, dtype=dtype, device=device)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, self.round_to)   # [T, K] each
        out = self.experts(x, weights, ids)                                                # [T, hidden]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.comm is None else self.comm.all_reduce(out)
