"""FP8 e4m3 linears (`engine/fp8.py`): the dequantizing reference path, and `_scaled_mm`'s call.

Stated bound (`LAYER_REL_ERROR`): each projection of the `tiny` preset, over random inputs (unit
normal, and rows scaled up to 10x with outlier columns), keeps ||y_fp8 - y|| / ||y|| <= 0.05
against the float layer (measured 3.0-3.8%; bf16 weights alone: 0.3%). e4m3 keeps 3 mantissa
bits, so each operand carries up to 2**-4 relative rounding error; per-channel weight scales and
per-token activation scales keep every row and channel on its own range.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import fp8 as fp8_module
from engine.fp8 import FP8, Fp8Linear, quantize_model_fp8, quantize_rows_fp8, quantize_weight_fp8
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.presets import resolve_model_dir

LAYER_REL_ERROR = 0.05


def _linear(k: int, n: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).requires_grad_(False)


def test_weight_quantization_is_per_channel_within_half_a_step():
    w = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]   # channels of very different ranges
    q, scale = quantize_weight_fp8(w)
    assert q.dtype == FP8 and scale.shape == (48,)
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((48,), 448.0))  # every row uses the range
    back = q.float() * scale[:, None]
    normal = (w / scale[:, None]).abs() >= 2**-6
    assert bool(((back - w).abs()[normal] <= w.abs()[normal] * 2**-4 + 1e-9).all())


def test_activation_rows_are_independent_and_static_scales_saturate():
    x = torch.randn(5, 32)
    x[2] *= 1000
    q, scale = quantize_rows_fp8(x)
    assert scale.shape == (5, 1)
    q1, s1 = quantize_rows_fp8(x[1:2])
    assert torch.equal(q[1:2].view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s1, scale[1:2])
    q, scale = quantize_rows_fp8(x, torch.tensor(0.01))
    assert float(q.float().abs().max()) == 448.0 and torch.equal(scale, torch.full((5, 1), 0.01))


@pytest.mark.parametrize("shape", [(1, 256, 688), (7, 100, 37), (33, 64, 96), (0, 64, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_path_is_the_scaled_product(shape, bias):
    rows, k, n = shape
    lin = _linear(k, n, bias)
    x = torch.randn(rows, k) * 3
    layer = Fp8Linear.from_linear(lin)
    assert not layer.use_scaled_mm                        # CPU: the dequantizing reference
    y = layer(x)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    x_q, x_s = quantize_rows_fp8(x)
    w_q, w_s = quantize_weight_fp8(lin.weight)
    expected = (x_q.double() @ w_q.double().t()) * x_s.double() * w_s.double()
    if bias:
        expected += lin.bias.double()
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)
    if rows:
        assert float((y - lin(x)).norm() / lin(x).norm()) <= LAYER_REL_ERROR


def test_every_projection_of_tiny_stays_within_the_stated_bound():
    path = resolve_model_dir("tiny")
    model = load_model(path, ModelConfig.from_dir(path), torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    errors = {}
    for name, lin in model.named_modules():
        if not isinstance(lin, nn.Linear) or name == "lm_head":
            continue
        layer = Fp8Linear.from_linear(lin)
        for heavy in (False, True):
            x = torch.randn(64, lin.in_features, generator=gen)
            if heavy:  # rows of different magnitudes, a few outlier columns
                x = x * torch.rand(64, 1, generator=gen) * 10
                x[:, :4] *= 20
            y = lin(x)
            errors[name, heavy] = float((layer(x) - y).norm() / y.norm())
    assert len(errors) == 2 * 4 * model.cfg.num_layers
    assert max(errors.values()) <= LAYER_REL_ERROR, max(errors.items(), key=lambda kv: kv[1])
    assert min(errors.values()) > 0.005            # it really is fp8, not a float passthrough


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rowwise", [True, False])
def test_scaled_mm_call_matches_the_reference(monkeypatch, dtype, rowwise):
    """The GPU path's `torch._scaled_mm` call (layout, scale shapes, the unit-scale fallback) runs
    on this CPU build of torch where it supports it: it must agree with the reference path."""
    a = torch.ones((16, 32)).to(FP8)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones((16, 1)), scale_b=torch.ones((1, 16)), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {e}")
    lin = _linear(64, 96, bias=True).to(dtype)
    layer = Fp8Linear.from_linear(lin)
    x = (torch.randn(9, 64) * 2).to(dtype)
    reference = layer(x)
    monkeypatch.setattr(fp8_module, "_rowwise_scaled_mm", lambda *args: rowwise)
    layer.use_scaled_mm = True
    fast = layer(x)
    assert fast.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fast.float(), reference.float(), **tol)


def test_quantize_model_fp8_keeps_the_lm_head_float():
    path = resolve_model_dir("tiny")
    model = load_model(path, ModelConfig.from_dir(path), torch.float32, torch.device("cpu"))
    assert quantize_model_fp8(model) == 4 * model.cfg.num_layers
    assert isinstance(model.layers[0].self_attn.qkv_proj, Fp8Linear)
    if model.lm_head is not None:
        assert not isinstance(model.lm_head, Fp8Linear) and model.lm_head.weight.dtype == torch.float32
    assert model.layers[0].mlp.down_proj.weight.dtype == FP8
    # bf16 in, bf16 out; the half-precision result stays close to the fp32 one.
    layer = model.layers[0].mlp.down_proj
    x = torch.randn(4, layer.in_features)
    torch.testing.assert_close(layer(x.bfloat16()).float(), layer(x), rtol=0.05, atol=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_mm_on_the_gpu_matches_the_reference_path(dtype):
    """On a GPU with fp8 tensor cores the layer takes `_scaled_mm`; it must agree with the
    dequantizing reference computed on the same device."""
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("no fp8 tensor cores")
    lin = _linear(256, 688, bias=True).to(device=device, dtype=dtype)
    layer = Fp8Linear.from_linear(lin)
    assert layer.use_scaled_mm
    x = (torch.randn(37, 256, device=device) * 2).to(dtype)
    fast = layer(x)
    layer.use_scaled_mm = False
    reference = layer(x)
    torch.testing.assert_close(fast.float(), reference.float(), rtol=2e-2, atol=2e-2)
    assert float((fast.float() - lin(x).float()).norm() / lin(x).float().norm()) <= LAYER_REL_ERROR


@pytest.mark.gpu
def test_fp8_engine_on_the_gpu_stays_close_to_bf16():
    """`--quantization fp8 --kv-cache-dtype fp8` on CUDA (Triton kernels, `_scaled_mm`): the first
    step's logits within 15% of the bf16 engine's (the CPU bound for per-tensor checkpoints)."""
    from engine.config import CacheConfig, SchedulerConfig
    from engine.engine import Engine, EngineConfig
    from engine.sampling.params import SamplingParams

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    logits = []
    for quantization, kv in ((None, "auto"), ("fp8", "fp8")):
        engine = Engine(EngineConfig(model="tiny", device="cuda", dtype="bfloat16", quantization=quantization,
                                     cache=CacheConfig(num_blocks=64, kv_cache_dtype=kv),
                                     scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8)))
        req = engine.add_request([1, 17, 200, 33, 90, 4, 250, 18, 77], SamplingParams(max_tokens=4))
        logits.append(engine.runner.run(engine.scheduler.schedule().scheduled).float()[0].cpu())
        engine.abort(req.request_id)
        out = engine.generate([[1, 5, 9, 33]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert len(out[0].output_token_ids) == 8
    ref, got = logits
    assert float((got - ref).norm() / ref.norm()) <= 0.15


def test_moe_experts_quantize_per_channel_and_the_routers_stay_float(tmp_path):
    from engine.models.moe import SparseMoE
    from tests.engine.hf_models import make_hf_model

    make_hf_model("qwen2_moe_packed", tmp_path)            # a shared expert, a dense layer among MoE ones
    model = load_model(tmp_path, ModelConfig.from_dir(tmp_path), torch.float32, torch.device("cpu"))
    moe = model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    x = torch.randn(16, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    want = moe(x)
    float_experts = moe.experts.gate_up_proj.clone()
    quantize_model_fp8(model)
    experts = moe.experts
    assert experts.gate_up_proj.dtype == FP8 and experts.down_proj.dtype == FP8
    assert experts.gate_up_scale.shape == experts.gate_up_proj.shape[:2]
    assert experts.down_scale.shape == experts.down_proj.shape[:2]
    torch.testing.assert_close(experts.gate_up_proj.float() * experts.gate_up_scale[..., None], float_experts,
                               rtol=2**-4, atol=1e-6)
    assert type(moe.gate) is not Fp8Linear and type(moe.shared_expert_gate) is not Fp8Linear   # routers: float
    assert isinstance(moe.shared_expert.gate_up_proj, Fp8Linear)
    assert isinstance(model.layers[1].mlp.down_proj, Fp8Linear)                               # the dense layer
    got = moe(x)
    assert got.dtype == torch.float32
    assert float((got - want).norm() / want.norm()) <= LAYER_REL_ERROR
