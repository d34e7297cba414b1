"""Checkpoint loading: presets are deterministic, bad directories fail with messages that say why."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loader import CheckpointError, load_model, model_fingerprint
from engine.model_config import ModelConfig, ModelConfigError
from engine.presets import resolve_model_dir
from tests.engine.hf_models import make_hf_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf_model("llama_gqa", path)
    return path


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_tiny_preset_is_deterministic(tmp_path, monkeypatch):
    first = resolve_model_dir("tiny")
    monkeypatch.setenv("CBSERVE_CACHE_DIR", str(tmp_path))
    second = resolve_model_dir("tiny")
    assert first != second
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert model_fingerprint(first) == model_fingerprint(second)
    cfg = ModelConfig.from_dir(first)
    n_params = sum(t.numel() for t in a.values())
    assert 1_000_000 < n_params < 10_000_000 and cfg.num_kv_heads < cfg.num_heads


def test_unsupported_architecture(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    raw = json.loads((d / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match="unsupported architecture"):
        ModelConfig.from_dir(d)


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw.pop("hidden_size"), "missing required field 'hidden_size'"),
    (lambda raw: raw.update(num_key_value_heads=3), "multiple of"),
    (lambda raw: raw.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope scaling type"),
    (lambda raw: raw.update(hidden_act="gelu"), "hidden_act"),
])
def test_bad_config(hf_dir, tmp_path, edit, message):
    d = _copy(hf_dir, tmp_path / "m")
    raw = json.loads((d / "config.json").read_text())
    edit(raw)
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dir(d)


@pytest.mark.parametrize("change, message", [
    ("drop", "missing tensors for: layers.1.self_attn.qkv_proj.weight"),
    ("reshape", "has shape"),
    ("extra", "unexpected tensor"),
])
def test_bad_tensors(hf_dir, tmp_path, change, message):
    d = _copy(hf_dir, tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    if change == "drop":
        del tensors[name]
    elif change == "reshape":
        tensors[name] = tensors[name][:-1]
    else:
        tensors["model.layers.1.self_attn.rotary_extra.weight"] = torch.zeros(2)
    save_file(tensors, str(d / "model.safetensors"))
    cfg = ModelConfig.from_dir(d)
    with pytest.raises(CheckpointError, match=message):
        load_model(d, cfg, torch.float32, torch.device("cpu"))


def test_no_weights(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(d, ModelConfig.from_dir(d), torch.float32, torch.device("cpu"))


def test_cli_generate_prints_only_the_text():
    cmd = [sys.executable, "-m", "cbserve.cli", "generate", "--model", "tiny", "--prompt", "Hi there",
           "--max-tokens", "8", "--temperature", "0"]
    a = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    b = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert a.stdout == b.stdout and a.stdout.endswith("\n")
    assert "engine ready" in a.stderr and "engine ready" not in a.stdout
    bad = subprocess.run(cmd[:-2] + ["--temperature", "-1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "temperature" in bad.stderr
