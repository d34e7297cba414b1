"""Built-in models, made locally and deterministically on first use (no download).

`tiny` (~3M parameters) serves tests and the quick start; `small` (~0.2B, Llama-shaped) serves
benchmarks. Both have random weights from a fixed seed and a byte-level tokenizer, and are written
as an ordinary Hugging Face directory, so they load through the same code as real checkpoints.
This module is torch-free unless weights are being created (the router uses it for tokenizers).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
from contextlib import contextmanager
from pathlib import Path

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, seed=0),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, seed=1),
}
# 2: a preset with its own vocab_size (`small`, the bench shapes) gets a tokenizer of that size,
# so every id the model can emit decodes to text (filler tokens past the 260 bytes and specials).
FORMAT_VERSION = 2


def cache_dir() -> Path:
    return Path(os.environ.get("CBSERVE_CACHE_DIR", Path.home() / ".cache" / "cbserve"))


def hf_config(name: str, tokenizer_vocab: int) -> dict:
    p = PRESETS[name]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": p["hidden_size"],
        "intermediate_size": p["intermediate_size"],
        "num_hidden_layers": p["num_hidden_layers"],
        "num_attention_heads": p["num_attention_heads"],
        "num_key_value_heads": p["num_key_value_heads"],
        "head_dim": p["hidden_size"] // p["num_attention_heads"],
        "vocab_size": p.get("vocab_size", tokenizer_vocab),
        "max_position_embeddings": p["max_position_embeddings"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "cbserve_preset": {"name": name, "seed": p["seed"], "format": FORMAT_VERSION},
    }


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pods starting together build a preset once
        yield


def resolve_model_dir(name_or_path: str | Path, create_weights: bool = True) -> Path:
    """A preset name -> its directory (built on first use); anything else is a local HF directory."""
    if str(name_or_path) not in PRESETS:
        path = Path(name_or_path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {str(name_or_path)!r} is neither a preset ({', '.join(PRESETS)}) "
                f"nor a directory with config.json")
        return path
    name = str(name_or_path)
    path = cache_dir() / "models" / f"{name}-v{FORMAT_VERSION}"
    with _locked(path):
        if not (path / "tokenizer.json").is_file() or not (path / "config.json").is_file():
            from engine.tokenizer import Tokenizer, build_byte_level_tokenizer

            path.mkdir(parents=True, exist_ok=True)
            build_byte_level_tokenizer(path, vocab_size=PRESETS[name].get("vocab_size"))
            vocab = Tokenizer.from_pretrained(path).vocab_size
            tmp = path / "config.json.tmp"
            tmp.write_text(json.dumps(hf_config(name, vocab), indent=2))
            tmp.replace(path / "config.json")
        if create_weights and not (path / "model.safetensors").is_file():
            _write_weights(path, name)
    return path


def _write_weights(path: Path, name: str) -> None:
    import torch
    from safetensors.torch import save_file

    from engine.progress import progress

    cfg = json.loads((path / "config.json").read_text())
    gen = torch.Generator().manual_seed(PRESETS[name]["seed"])
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden)}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes.update({
            pre + "self_attn.q_proj.weight": (q, hidden),
            pre + "self_attn.k_proj.weight": (kv, hidden),
            pre + "self_attn.v_proj.weight": (kv, hidden),
            pre + "self_attn.o_proj.weight": (hidden, q),
            pre + "mlp.gate_proj.weight": (inter, hidden),
            pre + "mlp.up_proj.weight": (inter, hidden),
            pre + "mlp.down_proj.weight": (hidden, inter),
            pre + "input_layernorm.weight": (hidden,),
            pre + "post_attention_layernorm.weight": (hidden,),
        })
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (cfg["vocab_size"], hidden)
    tensors = {}
    bar = progress(shapes.items(), desc=f"generating {name} weights", total=len(shapes), unit="tensor")
    for tensor_name, shape in bar:  # insertion order: deterministic draws
        if len(shape) == 1:
            tensors[tensor_name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            # 1/sqrt(fan_in) keeps activations O(1), so random logits are peaked, not uniform.
            std = 1.0 if "embed_tokens" in tensor_name else 1.0 / math.sqrt(shape[1])
            tensors[tensor_name] = torch.randn(shape, generator=gen) * std
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / "model.safetensors")
