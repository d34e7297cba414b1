"""Load Hugging Face Llama-family weights (`*.safetensors`) into `LlamaForCausalLM`.

The checkpoint keeps q/k/v and gate/up as separate tensors; the model fuses each group into one
matmul, so they are stacked here. Every expected tensor must appear exactly once with the right
shape: a missing, duplicated, unexpected or mis-shaped tensor is a `CheckpointError` naming it.
A parameter with a `weight_loader(tensor, index, hf_name)` attribute places its tensors itself
(FP8 weights and their scales: engine/fp8_checkpoint.py); it checks what it takes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model import LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.progress import progress
from engine.tp_shard import TPShard

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# HF name fragment -> (our parameter, index of the slice in the fused tensor)
FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class CheckpointError(ValueError):
    """A checkpoint directory whose tensors do not fit its config."""


def checkpoint_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


def _target(name: str, cfg: ModelConfig) -> tuple[str, int | None] | None:
    """HF tensor name -> (our parameter name, fused slice index or None); None = ignore."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    if name.startswith("model."):
        name = name[len("model."):]
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None
    for hf, (ours, index) in FUSED.items():
        if f".{hf}." in f".{name}":
            return name.replace(hf, ours), index
    return name, None


def _slices(cfg: ModelConfig, fused_name: str) -> list[int]:
    if "qkv_proj" in fused_name:
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    return [cfg.intermediate_size, cfg.intermediate_size]


def _num_tensors(files: list[Path]) -> int:
    """Tensors in the checkpoint, for the progress bar (headers only: cheap)."""
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            total += len(f.keys())
    return total


def load_weights(model: LlamaForCausalLM, path: Path, shard: TPShard | None = None) -> None:
    """Fill `model` from the checkpoint at `path`; with a `shard` (tensor parallelism), only the
    rows/columns that rank owns are read from the files (`engine.tp_shard`), never a full tensor."""
    cfg = model.cfg
    params = dict(model.named_parameters())
    seen: dict[str, set[int | None]] = {name: set() for name in params}
    files = checkpoint_files(path)
    bar = progress(desc=f"loading {path.name}", total=_num_tensors(files), unit="tensor")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                bar.update(1)
                target = _target(hf_name, cfg)
                if target is None:
                    continue
                ours, index = target
                if ours not in params:
                    raise CheckpointError(f"unexpected tensor {hf_name!r} in {file.name}")
                if index in seen[ours]:
                    raise CheckpointError(f"tensor {hf_name!r} appears more than once")
                param = params[ours]
                custom = getattr(param, "weight_loader", None)
                if custom is not None:   # FP8 checkpoints (never tensor-parallel: the engine refuses)
                    custom(f.get_tensor(hf_name), index, hf_name)
                    seen[ours].add(index)
                    continue
                dest = param.data
                if index is not None:
                    sizes = _slices(cfg, ours)
                    start = sum(sizes[:index])
                    dest = param.data.narrow(0, start, sizes[index])
                if shard is not None and shard.size > 1:
                    tensor, dest = _read_shard(f, hf_name, ours, index, dest, shard)
                else:
                    tensor = f.get_tensor(hf_name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise CheckpointError(
                        f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, config expects {tuple(dest.shape)}")
                dest.copy_(tensor.to(dest.dtype))
                seen[ours].add(index)
    bar.close()
    missing = []
    for name, indices in seen.items():
        expected = {None} if not any(k in name for k in ("qkv_proj", "gate_up_proj")) else set(
            range(len(_slices(cfg, name))))
        if indices != expected:
            missing.append(name)
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing tensors for: {', '.join(sorted(missing))}")


def _read_shard(f, hf_name: str, ours: str, index: int | None, dest: torch.Tensor,
                shard: TPShard) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of one checkpoint tensor (read through `get_slice`: only those bytes),
    and the part of `dest` it fills. The full tensor's shape is checked against the global config."""
    view = f.get_slice(hf_name)
    full = tuple(view.get_shape())
    plan = shard.split(ours, index)
    if plan is None:
        if tuple(full) != tuple(dest.shape):
            raise CheckpointError(f"tensor {hf_name!r} has shape {full}, config expects {tuple(dest.shape)}")
        if ours.endswith("o_proj.bias") and shard.rank:
            return dest.new_zeros(dest.shape), dest   # row-parallel: summed by the all-reduce, added once
        return view[:], dest
    dim, part, length = plan
    expected = list(dest.shape)
    expected[dim] = length
    if list(full) != expected:
        raise CheckpointError(f"tensor {hf_name!r} has shape {full}, config expects {tuple(expected)}")
    if dim == 0:
        dest = dest.narrow(0, 0, len(part))   # vocab shards: padding rows past the checkpoint stay 0
        return view[part.start:part.stop], dest
    return view[:, part.start:part.stop], dest


def model_fingerprint(path: Path) -> str:
    """Cheap identity of a checkpoint: config + each file's name, size, header and edges.

    Two pods agree on it when they load the same files; it does not hash gigabytes at start-up."""
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    for file in checkpoint_files(path):
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(header_len, 1 << 20)))
            f.seek(max(0, size - (1 << 16)))
            h.update(f.read())
    return h.hexdigest()[:16]


def load_model(path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_position: int | None = None, shard: TPShard | None = None, comm=None) -> LlamaForCausalLM:
    """`cfg` is the global config; with `shard`/`comm` (tensor parallelism) the model holds and
    reads only that rank's share, and `comm` (`engine.tp_comm.TPComm`) runs its collectives."""
    model = LlamaForCausalLM(cfg, dtype, device, max_position, shard=shard, comm=comm)
    load_weights(model, path, shard)
    return model.eval()
