"""On a GPU: the compiled fused MoE kernel in bf16/fp16 against the fp32 reference, without a
host sync, and captured in a CUDA graph whose replays see new routings. Skipped without CUDA.

Tolerance (output vs the fp32 reference on the same half-precision inputs): fp16 atol/rtol 1e-2,
bf16 3e-2 (three roundings per expert, as transformers has them).
"""

from __future__ import annotations

import os

import pytest
import torch

import kernels
from kernels import backend
from kernels.moe_ref import fused_moe_ref

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA, compiled Triton"),
]
TOL = {torch.float16: dict(atol=1e-2, rtol=1e-2), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture(autouse=True)
def _force_triton():
    previous = backend.set_backend("triton")
    yield
    backend.set_backend(previous)


def _case(num_tokens, hidden, inter, num_experts, top_k, dtype, seed=0, skew=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((num_tokens, hidden), device="cuda", generator=g).to(dtype)
    w13 = (torch.randn((num_experts, 2 * inter, hidden), device="cuda", generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn((num_experts, hidden, inter), device="cuda", generator=g) / inter ** 0.5).to(dtype)
    logits = torch.randn((num_tokens, num_experts), device="cuda", generator=g)
    if skew:
        logits[:, 0] += 100.0                       # every token's first choice: expert 0
    weights, ids = torch.topk(logits.softmax(-1), top_k)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, hidden, inter, num_experts, top_k", [
    (1, 256, 128, 8, 2), (64, 512, 256, 128, 8), (300, 256, 192, 7, 3), (2048, 128, 64, 16, 1)])
@pytest.mark.parametrize("skew", [False, True])
def test_half_precision_matches_the_fp32_reference(dtype, num_tokens, hidden, inter, num_experts, top_k, skew):
    x, w13, w2, weights, ids = _case(num_tokens, hidden, inter, num_experts, top_k, dtype, skew=skew)
    torch.cuda.set_sync_debug_mode("error")          # any device -> host read raises
    try:
        out = kernels.fused_moe(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


def test_fp8_weights_match_the_dequantized_reference():
    x, w13, w2, weights, ids = _case(33, 256, 128, 8, 2, torch.bfloat16)
    s13, s2 = w13.float().abs().amax(-1) / 448, w2.float().abs().amax(-1) / 448
    q13, q2 = (w13.float() / s13[..., None]).to(torch.float8_e4m3fn), (w2.float() / s2[..., None]).to(torch.float8_e4m3fn)
    out = kernels.fused_moe(x, q13, q2, weights, ids, s13, s2)
    want = fused_moe_ref(x.float(), q13, q2, weights, ids, s13, s2)
    torch.testing.assert_close(out.float(), want, **TOL[torch.bfloat16])


def test_cuda_graph_replays_follow_new_routings():
    x, w13, w2, weights, ids = _case(32, 256, 128, 16, 4, torch.bfloat16)
    kernels.fused_moe(x, w13, w2, weights, ids)     # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.fused_moe(x, w13, w2, weights, ids)
    for seed in (1, 2):
        nx, _, _, nw, nids = _case(32, 256, 128, 16, 4, torch.bfloat16, seed=seed, skew=seed == 2)
        x.copy_(nx), weights.copy_(nw), ids.copy_(nids)
        graph.replay()
        torch.testing.assert_close(out, kernels.fused_moe(x, w13, w2, weights, ids), atol=0, rtol=0)
