"""gpt-oss (`GptOssForCausalLM`): attention sinks, alternating sliding/full layers, YaRN, and a
biased mixture of experts with a clamped SwiGLU, as transformers' `modeling_gpt_oss.py` computes.

The decoder is Llama's pre-norm layer; what differs lives in the shared layers, configured from
the config (engine/model_config.py): each attention layer has q/k/v/o biases, one learned sink
logit per head in its softmax denominator, and a 128-token window on the even layers
(`layer_types`); RoPE is YaRN with its attention factor on cos/sin; every MLP is a `SparseMoE`
whose router has a bias, routes top-k over the logits with a softmax over the k (= softmax, top-k,
renormalized), and whose experts add biases and gate with `(clamp(up) + 1) * g * sigmoid(1.702 g)`.

Checkpoints: transformers keeps the experts as `gate_up_proj [E, H, 2I]` (gate and up interleaved
by column) and `down_proj [E, I, H]`, i.e. `x @ W`; the router is `mlp.router`. OpenAI's release
stores the expert matrices as MXFP4 (`*_blocks` / `*_scales`, engine/models/mxfp4.py), dequantized
here at load. `checkpoint_tensors` turns either into cbserve's `[E, 2I, H]` (gate rows, then up
rows) / `[E, H, I]`, de-interleaving the gate/up bias the same way.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.models.causal_lm import CausalLM
from engine.models.moe import SparseMoE
from engine.models.mxfp4 import dequantize_mxfp4

_GATE_UP, _DOWN = "experts.gate_up_proj", "experts.down_proj"
_MXFP4 = ("_blocks", "_scales")


def _gate_then_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up (gate at the even indices of `dim`) -> all gates, then all ups."""
    pairs = t.unflatten(dim, (-1, 2))                           # [..., I, 2, ...]
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


class GptOssForCausalLM(CausalLM):
    hf_renames = ((r"\.mlp\.router\.", ".mlp.gate."),)

    def make_mlp(self, cfg, layer, dtype, device, comm):
        return SparseMoE(cfg, dtype, device, comm)

    def checkpoint_tensors(self, f) -> Iterator[tuple[str, torch.Tensor | None]]:
        names = set(f.keys())
        for name in f.keys():
            if name.endswith(_GATE_UP + "_blocks") or name.endswith(_DOWN + "_blocks"):
                base = name.removesuffix("_blocks")
                scales = base + "_scales"
                if scales not in names:
                    raise ValueError(f"MXFP4 tensor {name!r} has no {scales!r} beside it")
                weight = dequantize_mxfp4(f.get_tensor(name), f.get_tensor(scales), self._dtype())  # [E, out, in]
                yield base, _gate_then_up(weight, 1) if base.endswith(_GATE_UP) else weight
            elif name.endswith(_MXFP4):
                continue                    # scales: read with their blocks
            elif name.endswith(_GATE_UP):   # [E, H, 2I], interleaved columns -> [E, 2I, H]
                yield name, _gate_then_up(f.get_tensor(name), 2).transpose(1, 2)
            elif name.endswith(_DOWN):      # [E, I, H] -> [E, H, I]
                yield name, f.get_tensor(name).transpose(1, 2)
            elif name.endswith(_GATE_UP + "_bias"):
                yield name, _gate_then_up(f.get_tensor(name), 1)
            else:
                yield name, None

    def _dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype
