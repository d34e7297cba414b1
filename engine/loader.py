"""Load Hugging Face weights (`*.safetensors`) into a family's `CausalLM` (engine/models/).

The checkpoint keeps q/k/v and gate/up as separate tensors, and a mixture of experts often one
tensor per expert; the model fuses each group into one parameter, so they are stacked here (the
name mapping: engine/models/weights.py). Every expected tensor must appear exactly once with the
right shape: a missing, duplicated, unexpected or mis-shaped tensor is a `CheckpointError` naming
it. A parameter with a `weight_loader(tensor, index, hf_name)` attribute places its tensors
itself (FP8 weights and their scales: engine/fp8_checkpoint.py); it checks what it takes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model_config import ModelConfig
from engine.models.causal_lm import CausalLM
from engine.models.registry import model_class
from engine.models.weights import WeightTarget, covered_pieces, expected_pieces, map_name, part_sizes
from engine.progress import progress
from engine.tp.shard import TPShard


# Biases of row-parallel projections: rank 0 alone adds them (the all-reduce sums the ranks' outputs).
ROW_PARALLEL_BIASES = ("self_attn.o_proj.bias", "experts.down_proj_bias")


class CheckpointError(ValueError):
    """A checkpoint directory whose tensors do not fit its config."""


def checkpoint_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


def _num_tensors(files: list[Path]) -> int:
    """Tensors in the checkpoint, for the progress bar (headers only: cheap)."""
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            total += len(f.keys())
    return total


def _destination(cfg: ModelConfig, param: torch.Tensor, target: WeightTarget) -> torch.Tensor:
    """The part of `param` (our tensor) that the checkpoint tensor mapped to `target` fills."""
    dest = param.data if target.expert is None else param.data[target.expert]
    if target.part is None:
        return dest
    sizes = part_sizes(cfg, target.param, dest.shape[0])
    return dest.narrow(0, sum(sizes[:target.part]), sizes[target.part])


def load_weights(model: CausalLM, path: Path, shard: TPShard | None = None) -> None:
    """Fill `model` from the checkpoint at `path`; with a `shard` (tensor parallelism), only the
    rows/columns that rank owns are read from the files (`engine.tp.shard`), never a full tensor."""
    cfg = model.cfg
    params = dict(model.named_parameters())
    pieces = {name: expected_pieces(name, tuple(p.shape)) for name, p in params.items()}
    seen: dict[str, set] = {name: set() for name in params}
    files = checkpoint_files(path)
    bar = progress(desc=f"loading {path.name}", total=_num_tensors(files), unit="tensor")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for hf_name, converted in model.checkpoint_tensors(f):
                bar.update(1)
                target = map_name(hf_name, cfg, model.hf_renames, model.hf_ignored)
                if target is None:
                    continue
                ours = target.param
                if ours not in params:
                    raise CheckpointError(f"unexpected tensor {hf_name!r} in {file.name}")
                covers = covered_pieces(target, pieces[ours])
                if not covers:
                    raise CheckpointError(f"tensor {hf_name!r} does not fit {ours} (expert {target.expert} of "
                                          f"{tuple(params[ours].shape)})")
                if covers & seen[ours]:
                    raise CheckpointError(f"tensor {hf_name!r} appears more than once")
                param = params[ours]
                custom = getattr(param, "weight_loader", None)
                if custom is not None:   # FP8 checkpoints (never tensor-parallel: the engine refuses)
                    custom(f.get_tensor(hf_name) if converted is None else converted, target.part, hf_name)
                    seen[ours] |= covers
                    continue
                dest = _destination(cfg, param, target)
                if shard is not None and shard.size > 1:
                    view = f.get_slice(hf_name) if converted is None else _TensorView(converted)
                    tensor, dest = _read_shard(view, hf_name, target, dest, shard)
                else:
                    tensor = f.get_tensor(hf_name) if converted is None else converted
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise CheckpointError(
                        f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, config expects {tuple(dest.shape)}")
                dest.copy_(tensor.to(dest.dtype))
                seen[ours] |= covers
    bar.close()
    missing = sorted(name for name in params if seen[name] != pieces[name])
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing tensors for: {', '.join(missing)}")


class _TensorView:
    """A tensor a family converted at load (engine/models/causal_lm.py, `checkpoint_tensors`),
    sliced like a safetensors `get_slice` view."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def _read_shard(view, hf_name: str, target: WeightTarget, dest: torch.Tensor,
                shard: TPShard) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of one checkpoint tensor (`view`: `get_slice`'s, so only those bytes are
    read), and the part of `dest` it fills. The full tensor's shape is checked against the global
    config."""
    full = tuple(view.get_shape())
    plan = shard.split(target.param, target.part, per_expert=target.expert is not None)
    if plan is None:
        if tuple(full) != tuple(dest.shape):
            raise CheckpointError(f"tensor {hf_name!r} has shape {full}, config expects {tuple(dest.shape)}")
        if target.param.endswith(ROW_PARALLEL_BIASES) and shard.rank:
            return dest.new_zeros(dest.shape), dest   # row-parallel: summed by the all-reduce, added once
        return view[:], dest
    expected = list(dest.shape)
    expected[plan.dim] = plan.length
    if list(full) != expected:
        raise CheckpointError(f"tensor {hf_name!r} has shape {full}, config expects {tuple(expected)}")
    lead = (slice(None),) * plan.dim
    parts = [view[(*lead, slice(r.start, r.stop))] for r in plan.ranges]
    tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=plan.dim)
    if plan.dim == 0 and tensor.shape[0] < dest.shape[0]:
        dest = dest.narrow(0, 0, tensor.shape[0])   # vocab shards: padding rows past the checkpoint stay 0
    return tensor, dest


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


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_position: int | None = None,
                shard: TPShard | None = None, comm=None) -> CausalLM:
    """An empty model of `cfg`'s family (engine/models/registry.py), weights still to load."""
    return model_class(cfg.architecture)(cfg, dtype, device, max_position, shard=shard, comm=comm)


def load_model(path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_position: int | None = None, shard: TPShard | None = None, comm=None) -> CausalLM:
    """`cfg` is the global config; with `shard`/`comm` (tensor parallelism) the model holds and
    reads only that rank's share, and `comm` (`engine.tp.comm.TPComm`) runs its collectives."""
    model = build_model(cfg, dtype, device, max_position, shard=shard, comm=comm)
    load_weights(model, path, shard)
    return model.eval()
