"""Benchmark shapes: random-weight checkpoints the size of real models, made locally on first use.

`tiny` is the built-in preset (engine/presets.py). `1b` and `8b` have the shapes of Llama-3.2-1B
and Llama-3.1-8B (GQA 32/8 heads, vocab 128256, untied head) with random bf16 weights. Their
config.json and byte-level tokenizer come from engine/presets.py (the shape is registered as a
preset: its tokenizer has the shape's vocabulary, so every id decodes to text), so they land in
`~/.cache/cbserve/models/<name>-v2` like any preset. The weights do not: the preset writer draws
fp32 on the CPU, minutes and 32 GB for 8B, so here they are drawn on the
benchmark's device and written in bf16 shards, named and shaped by transformers' own Llama (a
meta-device model), so that both cbserve's loader and `from_pretrained` read the directory.

    python -m bench.shapes 1b --device cuda      # prints the directory
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

if __package__ in (None, ""):   # `python bench/shapes.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import presets  # noqa: E402

# Preset-style shape dicts (engine/presets.py keys); head_dim = hidden / heads as in the presets.
SHAPES: dict[str, dict] = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, seed=11),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, seed=12),
}
PRESET_NAMES = {"1b": "llama-3.2-1b-shape", "8b": "llama-3.1-8b-shape"}
INDEX = "model.safetensors.index.json"   # written last: its presence means the shards are complete
SHARD_BYTES = 2 << 30


def model_dir(shape: str, device: str = "cpu") -> Path:
    """The checkpoint directory of a shape (`tiny`, `1b`, `8b`), built on first use."""
    if shape in presets.PRESETS and shape not in SHAPES:
        return presets.resolve_model_dir(shape)
    return build_checkpoint(PRESET_NAMES.get(shape, shape), SHAPES[shape], device)


def build_checkpoint(name: str, shape: dict, device: str = "cpu") -> Path:
    """Config and tokenizer through `engine.presets`, then bf16 random weights (if not there yet)."""
    presets.PRESETS.setdefault(name, shape)     # hf_config() and resolve_model_dir() read it there
    path = presets.resolve_model_dir(name, create_weights=False)
    with presets._locked(path):
        config = json.loads((path / "config.json").read_text())
        if config.get("torch_dtype") != "bfloat16":   # pods and transformers load it as bf16
            config["torch_dtype"] = "bfloat16"
            tmp = path / "config.json.tmp"
            tmp.write_text(json.dumps(config, indent=2))
            tmp.replace(path / "config.json")
        if not (path / INDEX).is_file():
            write_random_weights(path, config, shape["seed"], device)
    return path


def hf_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, from transformers' Llama built on the meta device (no memory)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "cbserve_preset", "torch_dtype")}
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**fields))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def write_random_weights(path: Path, config: dict, seed: int, device: str) -> None:
    """bf16 shards of ~2 GiB plus the index. Values as the presets draw them: norms 1 + 0.1 N(0, 1),
    embeddings N(0, 1), matrices N(0, 1/fan_in) so activations and logits stay O(1)."""
    import torch
    from safetensors.torch import save_file

    dev = torch.device(device)
    gen = torch.Generator(dev).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in hf_tensor_shapes(config).items():
        t = torch.randn(shape, generator=gen, device=dev)
        if len(shape) == 1:
            t = 1.0 + 0.1 * t
        elif "embed_tokens" not in name:
            t *= 1.0 / math.sqrt(shape[1])
        t = t.to(torch.bfloat16).cpu()
        if size and size + t.numel() * 2 > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * 2
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(path / (file + ".tmp")), metadata={"format": "pt"})
        (path / (file + ".tmp")).replace(path / file)
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * 2 for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / (INDEX + ".tmp")).write_text(json.dumps(index, indent=1))
    (path / (INDEX + ".tmp")).replace(path / INDEX)


def engine_config_fields(cls, **values) -> tuple[dict, list[str]]:
    """`values` the dataclass `cls` has as fields, and the names it lacks: a benchmark passes
    options (`enforce_eager`, `gpu_memory_utilization`) that other versions of the engine lack."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names}, [k for k in values if k not in names]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=["tiny", *SHAPES])
    ap.add_argument("--device", default="cpu", help="where the random weights are drawn")
    args = ap.parse_args(argv)
    print(model_dir(args.shape, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
