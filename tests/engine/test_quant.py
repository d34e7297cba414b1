"""W8A8 int8 linears (`engine/quant.py`) and an engine built with `quantization="int8"`.

The reference for an int8 linear is the same arithmetic done in float64 on the dequantized operands
(what the int32 accumulation computes exactly); its distance to the float linear is quantization
error, which is bounded and reported, not asserted equal."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.quant import Int8Linear, quantize_model, quantize_rows, quantize_weight
from engine.sampling.params import SamplingParams


def _linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(in_features, out_features, bias=bias)
    lin.requires_grad_(False)
    return lin


@pytest.mark.parametrize("shape", [(1, 256, 688), (7, 100, 37), (33, 1024, 260), (0, 64, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_exact_integer_arithmetic_and_close_to_float(shape, bias):
    rows, k, n = shape
    lin = _linear(k, n, bias)
    x = torch.randn(rows, k) * 3
    y = Int8Linear.from_linear(lin)(x)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    w_q, w_scale = quantize_weight(lin.weight)
    x_q, x_scale = quantize_rows(x)
    assert w_q.dtype == x_q.dtype == torch.int8 and int(w_q.abs().max()) <= 127 and (rows == 0 or int(x_q.abs().max()) <= 127)
    expected = (x_q.double() @ w_q.double().t()) * x_scale.double() * w_scale.double()
    if bias:
        expected += lin.bias.double()
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-5)
    if rows:
        ref = lin(x)
        assert float((y - ref).abs().max() / ref.abs().max()) < 0.03  # quantization error, per-channel/per-token


def test_int8_linear_rows_do_not_depend_on_the_batch():
    lin = Int8Linear.from_linear(_linear(256, 512, bias=True))
    x = torch.randn(9, 256)
    x[4] *= 1000  # an outlier row changes nothing for the others: scales are per token
    batched = lin(x)
    for i in range(9):
        assert torch.equal(lin(x[i:i + 1])[0], batched[i])


def test_half_precision_input_comes_back_in_its_dtype():
    lin = Int8Linear.from_linear(_linear(64, 32, bias=False))
    x = torch.randn(3, 64)
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    torch.testing.assert_close(lin(x.bfloat16()).float(), lin(x), rtol=0.05, atol=0.05)


def test_quantize_model_swaps_every_linear_and_refuses_what_it_cannot_do():
    model = nn.Sequential(_linear(16, 32, True), nn.ReLU(), nn.Sequential(_linear(32, 8, False)))
    assert quantize_model(model, "int8", torch.device("cpu")) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model(torch.randn(2, 16)).shape == (2, 8)
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(nn.Sequential(), "int4", torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU only"):
        quantize_model(nn.Sequential(), "int8", torch.device("cuda"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="tiny", quantization="int4")


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(n - 1)]


def _engine(quantization: str | None, budget: int = 512) -> Engine:
    return Engine(EngineConfig(model="tiny", quantization=quantization, cache=CacheConfig(num_blocks=256),
                               scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


@pytest.fixture(scope="module")
def int8_engine() -> Engine:
    return _engine("int8")


def test_int8_engine_is_batch_invariant_and_chunk_invariant(int8_engine):
    """Greedy and seeded: a prompt alone in one chunk gives the tokens it gives batched with others,
    and the tokens it gives alone in 16-token chunks (the linears are exact integer arithmetic)."""
    prompts = [_prompt(s, 20 + 23 * s) for s in range(5)]
    for params in (SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)):
        alone = [int8_engine.generate([p], params)[0].output_token_ids for p in prompts]
        assert [o.output_token_ids for o in int8_engine.generate(prompts, params)] == alone
        chunked = _engine("int8", budget=16)
        assert [chunked.generate([p], params)[0].output_token_ids for p in prompts] == alone


def test_int8_engine_batched_and_chunked_at_once_mostly_agrees(int8_engine):
    """Batched *and* chunked, a prompt's chunk boundaries move with its neighbours' decodes, and
    attention's float rounding moves with them. int8 activations amplify that noise (a value near a
    rounding edge lands on the other side), so a near-tie can flip on this flat random model; the
    tokens before it are equal, and most tokens agree."""
    prompts = [_prompt(s, 20 + 23 * s) for s in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.output_token_ids for o in int8_engine.generate(prompts, params)]
    mixed = [o.output_token_ids for o in _engine("int8", budget=16).generate(prompts, params)]
    assert [m[0] for m in mixed] == [a[0] for a in alone]
    agree = sum(x == y for m, a in zip(mixed, alone) for x, y in zip(m, a))
    assert agree >= 0.8 * sum(len(a) for a in alone)


def test_int8_engine_stays_close_to_the_float_engine(int8_engine):
    """Same weights: the first-position logits agree to quantization error, and greedy starts alike."""
    assert "+int8" in int8_engine.fingerprint and int8_engine.fingerprint != _engine(None).fingerprint
    assert not any(isinstance(m, nn.Linear) for m in int8_engine.model.layers.modules())
    fp32 = _engine(None)
    prompt = _prompt(11, 40)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
    (ours_top,), (ref_top,) = (e.generate([prompt], first)[0].new_logprobs for e in (int8_engine, fp32))
    for (token, logprob), (ref_token, ref_logprob) in zip(ours_top.top, ref_top.top):
        assert abs(logprob - ref_logprob) < 0.05
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ours, ref = int8_engine.generate([prompt], params)[0], fp32.generate([prompt], params)[0]
    assert ours.output_token_ids[0] == ref.output_token_ids[0]
    agree = sum(a == b for a, b in zip(ours.output_token_ids, ref.output_token_ids))
    assert agree >= 4, (ours.output_token_ids, ref.output_token_ids)


def test_the_int_mm_fallback_equals_the_onednn_kernel(monkeypatch):
    """Builds without oneDNN's qlinear take `torch._int_mm`; both give the same floats, bit for bit."""
    import engine.quant as quant

    lin, x = _linear(96, 40, bias=True), torch.randn(5, 96)
    onednn = Int8Linear.from_linear(lin)
    monkeypatch.setattr(quant, "onednn_int8_available", lambda: False)
    fallback = Int8Linear.from_linear(lin)
    assert not fallback.onednn and fallback.weight_q.dtype == torch.int8
    if onednn.onednn:
        assert torch.equal(onednn(x), fallback(x))
    torch.testing.assert_close(fallback(x), lin(x), rtol=0.03, atol=0.03)


def test_int8_refuses_a_mixture_of_experts_by_name(tmp_path):
    from tests.engine.hf_models import make_hf_model

    make_hf_model("mixtral", tmp_path)
    with pytest.raises(ValueError, match=r"--quantization int8 does not cover mixture-of-experts layers \(mixtral"):
        Engine(EngineConfig(model=str(tmp_path), quantization="int8"))
