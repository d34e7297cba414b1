"""The families beyond Llama: config parsing, the dense/MoE layer placement, both expert
checkpoint layouts, and the refusals. Token equality with transformers is in
test_hf_equivalence.py (TP=1) and test_tensor_parallel.py (TP=2)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.loader import CheckpointError, load_model
from engine.model_config import ModelConfig, ModelConfigError
from engine.models.moe import SparseMoE
from engine.models.registry import ARCHITECTURES, FAMILIES, model_class
from tests.engine.hf_models import CONFIGS, make_hf_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (directory, HF model) for the MoE and Qwen3 test configs, plus a per-expert copy of
    the packed Qwen2-MoE checkpoint (same weights, the other layout)."""
    out = {}
    for name in ("qwen3", "mixtral", "qwen2_moe_packed", "qwen3_moe"):
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, make_hf_model(name, path))
    path = tmp_path_factory.mktemp("qwen2_moe_per_expert")
    out["qwen2_moe_packed"][1].save_pretrained(path)           # default: per-expert tensors
    out["qwen2_moe_per_expert"] = (path, out["qwen2_moe_packed"][1])
    return out


def test_every_architecture_has_a_family_class():
    for family in set(ARCHITECTURES.values()):
        assert family in FAMILIES and model_class(family).__name__.endswith("ForCausalLM")


def test_configs_parse_per_family(saved):
    qwen3 = ModelConfig.from_dir(saved["qwen3"][0])
    assert (qwen3.architecture, qwen3.head_dim, qwen3.qk_norm, qwen3.qkv_bias, qwen3.o_bias) == ("qwen3", 24, True,
                                                                                                 True, True)
    assert qwen3.q_size == 96 != qwen3.hidden_size
    mixtral = ModelConfig.from_dir(saved["mixtral"][0])
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size,
            mixtral.norm_topk_prob, mixtral.round_router_weights) == (3, 2, 96, True, False)
    qwen2 = ModelConfig.from_dir(saved["qwen2_moe_packed"][0])
    assert (qwen2.num_experts, qwen2.num_experts_per_tok, qwen2.norm_topk_prob, qwen2.shared_expert_intermediate_size,
            qwen2.mlp_only_layers, qwen2.qkv_bias, qwen2.o_bias) == (5, 3, False, 80, (1,), True, False)
    qwen3_moe = ModelConfig.from_dir(saved["qwen3_moe"][0])
    raw = json.loads((saved["qwen3_moe"][0] / "config.json").read_text())
    assert "num_local_experts" in raw and "num_experts" not in raw     # transformers' attribute_map at work
    assert (qwen3_moe.num_experts, qwen3_moe.num_experts_per_tok, qwen3_moe.norm_topk_prob, qwen3_moe.qk_norm,
            qwen3_moe.decoder_sparse_step) == (4, 1, True, True, 2)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe_packed", "qwen3_moe"])
def test_moe_layers_sit_where_transformers_puts_them(saved, name):
    path, hf = saved[name]
    cfg = ModelConfig.from_dir(path)
    ours = [isinstance(layer.mlp, SparseMoE) for layer in load_model(path, cfg, torch.float32, CPU).layers]
    theirs = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert ours == theirs == [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    assert not all(ours) or name == "mixtral"       # the Qwen configs mix dense layers in


def test_missing_fields_take_the_transformers_defaults():
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    for arch, cls in (("Qwen3ForCausalLM", "Qwen3Config"), ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
                      ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"), ("MixtralForCausalLM", "MixtralConfig")):
        ours = ModelConfig.from_dict(dict(base, architectures=[arch]))
        theirs = getattr(transformers, cls)(**base)
        head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
        assert ours.head_dim == head_dim, arch
        if ours.num_experts:
            experts = getattr(theirs, "num_experts", None) or theirs.num_local_experts
            assert (ours.num_experts, ours.num_experts_per_tok) == (experts, theirs.num_experts_per_tok), arch
            assert ours.norm_topk_prob == getattr(theirs, "norm_topk_prob", True), arch


def test_the_family_comes_from_model_type_when_architectures_is_missing():
    raw = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, vocab_size=100, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    assert ModelConfig.from_dict(raw).architecture == "qwen3_moe"
    with pytest.raises(ModelConfigError, match="unsupported architecture 'gpt2'"):
        ModelConfig.from_dict(dict(raw, model_type="gpt2"))


def test_bad_moe_configs_name_the_field():
    raw = dict(architectures=["MixtralForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, vocab_size=100, num_local_experts=2, num_experts_per_tok=3)
    with pytest.raises(ModelConfigError, match=r"num_experts_per_tok \(3\) must be in \[1, num_experts \(2\)\]"):
        ModelConfig.from_dict(raw)


def test_both_expert_layouts_load_the_same_weights(saved):
    packed_dir, per_expert_dir = saved["qwen2_moe_packed"][0], saved["qwen2_moe_per_expert"][0]
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(str(packed_dir / "model.safetensors")))
    assert any(".experts.0.gate_proj." in k for k in load_file(str(per_expert_dir / "model.safetensors")))
    cfg = ModelConfig.from_dir(packed_dir)
    a = dict(load_model(packed_dir, cfg, torch.float32, CPU).named_parameters())
    b = dict(load_model(per_expert_dir, cfg, torch.float32, CPU).named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_mixtral_packed_layout_loads_like_its_per_expert_one(saved, tmp_path):
    path, hf = saved["mixtral"]
    hf.save_pretrained(tmp_path, save_original_format=False)
    keys = load_file(str(tmp_path / "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.down_proj" in keys and not any("block_sparse_moe" in k for k in keys)
    cfg = ModelConfig.from_dir(path)
    a = dict(load_model(path, cfg, torch.float32, CPU).named_parameters())
    b = dict(load_model(tmp_path, cfg, torch.float32, CPU).named_parameters())
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("change, message", [
    ("drop_expert", "missing tensors for: layers.0.mlp.experts.gate_up_proj"),
    ("both_layouts", "appears more than once"),
    ("expert_out_of_range", "does not fit layers.0.mlp.experts.down_proj"),
    ("reshape_packed", "has shape"),
])
def test_bad_expert_tensors(saved, tmp_path, change, message):
    src = saved["qwen2_moe_per_expert"][0]
    d = tmp_path / "m"
    shutil.copytree(src, d)
    tensors = load_file(str(d / "model.safetensors"))
    packed = load_file(str(saved["qwen2_moe_packed"][0] / "model.safetensors"))
    if change == "drop_expert":
        del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    elif change == "both_layouts":
        tensors["model.layers.0.mlp.experts.gate_up_proj"] = packed["model.layers.0.mlp.experts.gate_up_proj"]
    elif change == "expert_out_of_range":
        tensors["model.layers.0.mlp.experts.5.down_proj.weight"] = tensors["model.layers.0.mlp.experts.0.down_proj.weight"].clone()
    else:
        for k in [k for k in tensors if k.startswith("model.layers.0.mlp.experts.")]:
            del tensors[k]
        tensors["model.layers.0.mlp.experts.gate_up_proj"] = packed["model.layers.0.mlp.experts.gate_up_proj"][:4]
        tensors["model.layers.0.mlp.experts.down_proj"] = packed["model.layers.0.mlp.experts.down_proj"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_model(d, ModelConfig.from_dir(d), torch.float32, CPU)


def test_packed_experts_run_the_same_as_plain_ones(saved):
    # CPU: pack_weights() moves every expert onto oneDNN; the outputs stay equal to the plain path.
    from engine.models.linear import onednn_linear_available
    if not onednn_linear_available():
        pytest.skip("no oneDNN")
    path = saved["qwen2_moe_packed"][0]
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, torch.float32, CPU)
    moe = model.layers[0].mlp
    x = torch.randn((5, cfg.hidden_size), generator=torch.Generator().manual_seed(0))
    plain = moe(x)
    assert model.pack_weights() > 0 and moe.experts.packed is not None
    assert not hasattr(moe.experts, "gate_up_proj") or moe.experts.gate_up_proj is None
    torch.testing.assert_close(moe(x), plain, atol=1e-5, rtol=1e-5)


def test_every_family_is_tested_against_transformers():
    # Guard: each family of the registry has a checkpoint in the equivalence suites (the window
    # families' in test_window_models.py).
    from tests.engine.hf_window_models import WINDOW_CONFIGS

    configs = [*CONFIGS.values(), *WINDOW_CONFIGS.values()]
    assert {ARCHITECTURES[model_cls] for _, model_cls, *_ in configs} == set(FAMILIES)


def test_padded_moe_decode_step_equals_the_unpadded_one(saved):
    """The CUDA-graph path's logic on CPU: padding rows of a bucketed decode batch route to
    experts too, and must change nothing for the real rows."""
    from engine.kv_cache import allocate_kv_cache
    from engine.model_runner import ModelRunner
    from engine.scheduling.scheduler import ScheduledSeq

    path = saved["mixtral"][0]
    cfg = ModelConfig.from_dir(path)
    runners = [ModelRunner(load_model(path, cfg, torch.float32, CPU), allocate_kv_cache(cfg, 40, 4, torch.float32, CPU),
                           4, CPU, max_num_seqs=16, max_model_len=64, enforce_eager=eager) for eager in (True, False)]
    for runner in runners:
        runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(1)))
    batch = [ScheduledSeq(f"r{i}", (3 + 7 * i,), start, tuple(range(1 + 3 * i, 2 + 3 * i + start // 4)), True)
             for i, start in enumerate([0, 5, 9, 2, 11])]
    eager, padded = runners
    assert padded.decode_buckets.bucket(batch) is not None
    torch.testing.assert_close(padded.run(batch), eager.run(batch), atol=1e-5, rtol=1e-5)
    assert torch.equal(padded.kv_cache, eager.kv_cache)


def test_fp8_checkpoints_of_moe_models_are_refused_by_name(saved, tmp_path):
    from engine.engine import Engine, EngineConfig

    d = tmp_path / "m"
    shutil.copytree(saved["mixtral"][0], d)
    raw = json.loads((d / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"FP8 checkpoints of mixture-of-experts models \(mixtral\)"):
        Engine(EngineConfig(model=str(d)))
