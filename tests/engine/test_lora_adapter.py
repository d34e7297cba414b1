"""Adapters that do not fit are refused at registration with a message naming why, never in a
step: rank above --max-lora-rank, shapes of another base model, unsupported targets (embeddings,
MoE experts), PEFT options that change the math, broken files; names, paths and runtime loading
are checked; `--lora-modules` parses vLLM's two forms."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from engine.config import CacheConfig
from engine.engine import Engine, EngineConfig
from engine.lora.config import LoRAConfig, LoRAModule, parse_lora_module
from engine.lora.errors import (LoRAAdapterError, LoRAExistsError, LoRANotFoundError,
                                LoRAPermissionError)
from engine.sampling.params import SamplingParams
from tests.engine.hf_models import make_hf_model
from tests.engine.lora_adapters import make_adapter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    hf = make_hf_model("llama_gqa", root / "base")
    good = make_adapter(hf, root / "adapters" / "good", r=8)
    engine = Engine(EngineConfig(model=str(root / "base"), cache=CacheConfig(block_size=8, num_blocks=32),
                                 lora=LoRAConfig(max_loras=1, max_lora_rank=8, allow_runtime_lora_updating=True,
                                                 lora_root=str(root / "adapters"))))
    return root, hf, good, engine


def _variant(src, dst, config_changes=None, tensors=None):
    shutil.copytree(src, dst)
    if config_changes:
        config = json.loads((dst / "adapter_config.json").read_text())
        config.update(config_changes)
        (dst / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def _bad_adapters(root, hf, good):
    """name -> (adapter directory, expected error)"""
    adapters = root / "adapters"
    other = make_hf_model("mistral", root / "other-base")   # another hidden size: shapes do not fit
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    expert = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    return {
        "rank": (make_adapter(hf, adapters / "r16", r=16), "rank 16 exceeds --max-lora-rank 8"),
        "shapes": (make_adapter(other, adapters / "other", r=4), "do not fit the base model"),
        "dora": (_variant(good, adapters / "dora", {"use_dora": True}), "use_dora=True is not supported"),
        "bias": (_variant(good, adapters / "bias", {"bias": "all"}), "bias='all' is not supported"),
        "modules_to_save": (_variant(good, adapters / "mts", {"modules_to_save": ["lm_head"]}),
                            "modules_to_save"),
        "embedding": (_variant(good, adapters / "emb", tensors={
            "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 300)}), "not a LoRA A/B weight"),
        "head": (_variant(good, adapters / "head", tensors={
            "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(300, 8)}), "target lm_head"),
        "experts": (_variant(good, adapters / "experts", tensors={
            f"{expert}.lora_A.weight": torch.zeros(8, 64), f"{expert}.lora_B.weight": torch.zeros(160, 8)}),
            "experts of a mixture of experts"),
        "half": (_variant(good, adapters / "half", tensors={f"{q}.lora_A.weight": torch.zeros(8, 64)}),
                 "lora_B is missing"),
        "corrupt": (_variant(good, adapters / "corrupt"), "unreadable safetensors"),
        "missing": (adapters / "nowhere", "is not a directory"),
    }


def test_bad_adapters_are_refused_with_the_reason(setup):
    root, hf, good, engine = setup
    bad = _bad_adapters(root, hf, good)
    (bad["corrupt"][0] / "adapter_model.safetensors").write_bytes(b"\x00" * 40)
    for case, (path, message) in bad.items():
        with pytest.raises(LoRAAdapterError, match=message):
            engine.lora.registry.register(f"bad-{case}", str(path), runtime=True)
    assert not engine.lora.registry.registered()          # nothing half-registered
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))   # the engine is unharmed
    assert len(out[0].output_token_ids) == 3


def test_names_paths_and_runtime_loading(setup, tmp_path):
    root, _, good, engine = setup
    registry = engine.lora.registry
    registered = registry.register("good", "good", runtime=True)       # relative to --lora-root
    assert registered.path == str((root / "adapters" / "good").resolve())
    with pytest.raises(LoRAExistsError, match="already loaded"):
        registry.register("good", str(good), runtime=True)
    outside = shutil.copytree(good, tmp_path / "outside")
    with pytest.raises(LoRAPermissionError, match="outside --lora-root"):
        registry.register("escape", str(outside), runtime=True)
    with pytest.raises(LoRAPermissionError, match="outside --lora-root"):
        registry.register("escape", "../../" + str(outside), runtime=True)
    (root / "adapters" / "link").symlink_to(outside)                    # a symlink out is still out
    with pytest.raises(LoRAPermissionError, match="outside --lora-root"):
        registry.register("escape", "link", runtime=True)
    with pytest.raises(LoRAAdapterError, match="without spaces or commas"):
        registry.register("a,b", "good", runtime=True)
    with pytest.raises(LoRANotFoundError, match="'nope' does not exist"):
        engine.add_request([1, 2], lora="nope")
    registry.unregister("good")
    with pytest.raises(LoRANotFoundError):
        registry.unregister("good")


def test_runtime_loading_is_off_unless_enabled(tmp_path):
    hf = make_hf_model("llama_gqa", tmp_path / "base")
    path = make_adapter(hf, tmp_path / "a", r=8)
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), cache=CacheConfig(block_size=8, num_blocks=16),
                                 lora=LoRAConfig(lora_modules=(LoRAModule("startup", str(path)),))))
    with pytest.raises(LoRAPermissionError, match="--allow-runtime-lora-updating"):
        engine.lora.registry.register("runtime", str(path), runtime=True)
    assert [a.name for a in engine.lora.registry.registered()] == ["startup"]   # startup paths: not restricted


def test_an_evicted_adapter_whose_files_changed_is_refused(tmp_path):
    hf = make_hf_model("llama_gqa", tmp_path / "base")
    a, b = make_adapter(hf, tmp_path / "a", r=8, seed=1), make_adapter(hf, tmp_path / "b", r=8, seed=2)
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), cache=CacheConfig(block_size=8, num_blocks=16),
                                 lora=LoRAConfig(max_cpu_loras=1, lora_modules=(LoRAModule("a", str(a)),
                                                                                LoRAModule("b", str(b))))))
    assert engine.lora.registry.num_reads == 2 and len(engine.lora.registry.cached_identities()) == 1
    shutil.copy(b / "adapter_model.safetensors", a / "adapter_model.safetensors")   # a's files now differ
    with pytest.raises(LoRAAdapterError, match="changed on disk"):
        engine.add_request([1, 2, 3], lora="a")


def test_lora_modules_flag_forms():
    assert parse_lora_module("sql=/adapters/sql") == LoRAModule("sql", "/adapters/sql")
    assert parse_lora_module('{"name": "sql", "path": "/a/sql", "base_model_name": "m"}') == \
        LoRAModule("sql", "/a/sql", "m")
    for bad in ("sql", '{"name": "x"}', '{"name": "x", "path": "p", "other": 1}', "{oops", "a b=/p"):
        with pytest.raises(ValueError):
            parse_lora_module(bad)
    with pytest.raises(ValueError, match="more than once"):
        LoRAConfig(lora_modules=(LoRAModule("x", "/a"), LoRAModule("x", "/b")))
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    assert LoRAConfig(max_lora_rank=8).slot_rank == 16 and LoRAConfig(max_lora_rank=24).slot_rank == 32
