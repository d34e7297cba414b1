"""gpt-oss's experts in `kernels.fused_moe`: per-expert biases and the clamped SwiGLU.

The reference equals transformers' `GptOssExperts` loop (its own layout: `gate_up_proj [E, H, 2I]`
with gate and up interleaved by column, `down_proj [E, I, H]`) once the weights are moved into
cbserve's `[E, 2I, H]` (gate rows, then up rows) / `[E, H, I]`; the Triton kernel (interpreted on
CPU) equals the reference, fp32 and fp16, over skewed routings and a clamp that bites.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.moe_ref import fused_moe_ref

ALPHA, LIMIT = 1.702, 1.5


def _case(num_tokens, hidden, inter, num_experts, top_k, dtype, device, seed=0, skewed=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((num_tokens, hidden), generator=gen)
    gate_up = torch.randn((num_experts, hidden, 2 * inter), generator=gen) * 2 / hidden ** 0.5   # HF layout
    gate_up_bias = torch.randn((num_experts, 2 * inter), generator=gen) * 0.5
    down = torch.randn((num_experts, inter, hidden), generator=gen) / inter ** 0.5
    down_bias = torch.randn((num_experts, hidden), generator=gen) * 0.5
    if skewed:   # every token to experts 0 and 1: the others get nothing
        ids = torch.stack([torch.arange(top_k) for _ in range(num_tokens)])
    else:
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand((num_tokens, top_k), generator=gen).softmax(-1)
    hf = (x, gate_up, gate_up_bias, down, down_bias, weights, ids)
    # cbserve's layout: gate rows then up rows, [E, out, in].
    w13 = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
    b13 = torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=-1)
    w2 = down.transpose(1, 2).contiguous()
    ours = [t.to(dtype).to(device) for t in (x, w13, w2)] + [weights.to(device), ids.to(device)] + \
        [b13.to(dtype).to(device), down_bias.to(dtype).to(device)]
    return hf, ours


def _transformers_loop(x, gate_up, gate_up_bias, down, down_bias, weights, ids):
    """`GptOssExperts.forward` / `_apply_gate` of transformers 5, in fp64."""
    x, gate_up, gate_up_bias, down, down_bias = (t.double() for t in (x, gate_up, gate_up_bias, down, down_bias))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gu = x[t] @ gate_up[e] + gate_up_bias[e]
            gate, up = gu[::2].clamp(max=LIMIT), gu[1::2].clamp(min=-LIMIT, max=LIMIT)
            y = ((up + 1) * (gate * torch.sigmoid(gate * ALPHA))) @ down[e] + down_bias[e]
            out[t] += y * weights[t, k].double()
    return out


def _fused(x, w13, w2, weights, ids, b13, b2, fn=kernels.fused_moe):
    return fn(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, activation="swiglu_oai", swiglu_alpha=ALPHA,
              swiglu_limit=LIMIT)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, skewed", [(1, 4, 1, False), (9, 5, 2, False),
                                                                     (16, 6, 4, True)])
def test_reference_equals_transformers_experts(num_tokens, num_experts, top_k, skewed):
    hf, ours = _case(num_tokens, 24, 12, num_experts, top_k, torch.float32, "cpu", skewed=skewed)
    got = _fused(*ours, fn=fused_moe_ref)
    torch.testing.assert_close(got.double(), _transformers_loop(*hf), atol=1e-5, rtol=1e-5)
    # The clamp bites: some gate/up pre-activations lie outside [-LIMIT, LIMIT].
    x, gate_up, gate_up_bias = hf[:3]
    assert ((x @ gate_up[0] + gate_up_bias[0]).abs() > LIMIT).any()


@pytest.mark.parametrize("num_tokens, hidden, inter, num_experts, top_k, skewed", [
    (1, 32, 16, 8, 2, False),     # decode
    (5, 48, 40, 3, 1, False),     # odd experts, top-1, masked tile tails
    (21, 32, 24, 5, 4, True),     # top-4, skewed: three experts idle
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference(triton_backend, num_tokens, hidden, inter, num_experts, top_k, skewed, dtype):
    _, ours = _case(num_tokens, hidden, inter, num_experts, top_k, dtype, triton_backend, skewed=skewed)
    x, w13, w2, weights, ids, b13, b2 = ours
    out = _fused(x, w13, w2, weights, ids.to(torch.int32), b13, b2)
    want = _fused(*ours, fn=fused_moe_ref)
    # fp16: the kernel adds the bias before rounding the projection, the reference after (two
    # roundings): an ulp of the pre-activation, carried through the down projection.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(out, want, **tol)


def test_rejects_half_given_biases_and_unknown_activations():
    _, (x, w13, w2, weights, ids, b13, b2) = _case(3, 16, 8, 4, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="biases"):
        kernels.fused_moe(x, w13, w2, weights, ids, w13_bias=b13)
    with pytest.raises(ValueError, match="biases"):
        kernels.fused_moe(x, w13, w2, weights, ids, w13_bias=b13[:, :4], w2_bias=b2)
    with pytest.raises(ValueError, match="activation"):
        kernels.fused_moe(x, w13, w2, weights, ids, activation="gelu")
