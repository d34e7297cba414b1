"""LoRA-wrapped projections and the device slots every adapter in a batch lives in.

`attach_lora(model, num_slots, rank, shard)` wraps each projection of every `Attention`
(`qkv_proj`, `o_proj`) and dense `MLP` (`gate_up_proj`, `down_proj`; a shared expert is one)
in a `LoRALinear`: `y = base(x)`, then for the step's tokens that have an adapter
`y += B_slot (A_slot x)` through `kernels.lora_shrink` / `kernels.lora_expand`. Fused projections
keep one A and one B per part (q/k/v, gate/up): A's parts are stacked along its rank rows, and
the expand writes each part's columns from its own rank rows.

Memory: one tensor `storage [num_slots, slot_numel]` in the model dtype holds every slot, each
slot one contiguous row laid out module by module as `A [parts * rank, in]` then `B [out, rank]`
(this rank's shard under tensor parallelism); each `LoRALinear` sees strided views of it. It is
allocated once, at start, for `--max-loras` slots of `--max-lora-rank` (rounded up to a power of
two >= 16: the kernels' tile): registering more adapters costs no device memory, and loading
one into a slot is one copy of one row (`engine/lora/pack.py` builds that row on the host).

Tensor parallelism follows the base layer's layout (Megatron, engine/tp/shard.py): a
column-parallel layer (qkv, gate/up) keeps A whole and splits B's rows as its own; a row-parallel
layer (o, down) splits A's columns as its own and keeps B whole, and adds its partial product
before the layer's all-reduce, since `sum_i B (A_i x_i) = B (A x)`: no new collective.

The step's plan (`kernels.lora_plan` over `AttentionMetadata.lora_slots`, the per-token slot
ids the runner stages with the step's other inputs) is built once per forward, by a forward
pre-hook on the model, and read by every `LoRALinear` of that forward; a forward hook clears it.
A step with no adapter carries no slot ids and runs no LoRA at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import kernels
from engine.models.attention import Attention
from engine.models.mlp import MLP
from engine.models.weights import part_sizes

# (module class, its projections that take LoRA)
_WRAPPED = ((Attention, ("qkv_proj", "o_proj")), (MLP, ("gate_up_proj", "down_proj")))


@dataclass(frozen=True)
class LoRATarget:
    """One projection that takes LoRA: where its A and B sit in a slot, and its shapes."""

    path: str                                  # "layers.0.self_attn.qkv_proj"
    in_features: int                           # this rank's input columns
    part_sizes: tuple[int, ...]                # this rank's output rows of each fused part
    global_shapes: tuple[tuple[int, int], ...]  # (out, in) of each part in the unsharded model
    split_dims: tuple[int | None, ...]         # per part: 0 = rows split (column-parallel), 1 = columns, None
    rank: int                                  # slot rank (padded)
    a_offset: int                              # element offsets within a slot's row
    b_offset: int

    @property
    def param(self) -> str:
        return f"{self.path}.weight"

    @property
    def num_parts(self) -> int:
        return len(self.part_sizes)

    @property
    def out_features(self) -> int:
        return sum(self.part_sizes)

    @property
    def a_numel(self) -> int:
        return self.num_parts * self.rank * self.in_features

    @property
    def b_numel(self) -> int:
        return self.out_features * self.rank

    def global_shape(self, part: int | None) -> tuple[int, int]:
        """(out, in) of one part in the unsharded model; part None: the whole fused module."""
        if part is None:
            return sum(s[0] for s in self.global_shapes), self.global_shapes[0][1]
        if not 0 <= part < self.num_parts:
            raise IndexError(part)
        return self.global_shapes[part]


class _PlanHolder:
    """The current forward's `LoRAPlan` (None: no adapter in this step), shared by a model's
    `LoRALinear`s and set by the model's forward hooks (not a module global)."""

    plan: kernels.LoRAPlan | None = None


class LoRALinear(nn.Module):
    """`base(x)` plus each token's adapter, if any (see the module docstring)."""

    def __init__(self, base: nn.Module, target: LoRATarget, a: torch.Tensor, b: torch.Tensor,
                 holder: _PlanHolder) -> None:
        super().__init__()
        self.base = base
        self.target = target
        self.a = a                    # [S, parts * rank, in] view of the slot storage
        self.b = b                    # [S, out, rank]
        self.holder = holder
        sizes = target.part_sizes
        self.slice_starts = tuple(sum(sizes[:i]) for i in range(len(sizes)))

    @property
    def weight(self) -> torch.Tensor:   # what code reading `proj.weight` expects
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)                                             # [T, out]
        plan = self.holder.plan
        if plan is not None:
            h = kernels.lora_shrink(x, self.a, plan)                 # [T, parts * rank]
            kernels.lora_expand(y, h, self.b, plan, self.slice_starts)
        return y


class LoRAModel:
    """A model's LoRA targets and slot storage (returned by `attach_lora`)."""

    def __init__(self, model: nn.Module, targets: dict[str, LoRATarget], storage: torch.Tensor,
                 holder: _PlanHolder) -> None:
        self.targets = targets
        self.storage = storage                  # [num_slots, slot_numel]
        self.num_slots, self.slot_numel = storage.shape
        self._holder = holder
        model.register_forward_pre_hook(self._plan_step, with_kwargs=True)
        model.register_forward_hook(self._end_step, always_call=True)   # also when the forward raises

    @property
    def device_bytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def write_slot(self, slot: int, image: torch.Tensor) -> None:
        """Engine thread, between steps: slot `slot` now holds `image` ([slot_numel], host)."""
        self.storage[slot].copy_(image, non_blocking=True)

    def _plan_step(self, module, args, kwargs) -> None:
        meta = kwargs["meta"] if "meta" in kwargs else args[3]      # CausalLM.forward(ids, pos, kv, meta)
        slots = getattr(meta, "lora_slots", None)
        self._holder.plan = None if slots is None else kernels.lora_plan(slots, self.num_slots)

    def _end_step(self, module, args, output) -> None:
        self._holder.plan = None


def _global_shapes(target_param: str, in_features: int, sizes: list[int],
                   shard) -> tuple[tuple[tuple[int, int], ...], tuple[int | None, ...]]:
    shapes, dims = [], []
    for part, size in enumerate(sizes):
        plan = None if shard is None or shard.size == 1 else shard.split(target_param, part if len(sizes) > 1 else None)
        if plan is None:
            shapes.append((size, in_features))
            dims.append(None)
        elif plan.dim == 0:
            shapes.append((plan.length, in_features))
            dims.append(0)
        else:
            shapes.append((size, plan.length))
            dims.append(1)
    return tuple(shapes), tuple(dims)


def attach_lora(model: nn.Module, num_slots: int, rank: int, shard=None) -> LoRAModel:
    """Wrap `model`'s projections (after loading and quantizing, before the runner packs them)
    and allocate `num_slots` zeroed slots of `rank`; `shard` (engine.tp.shard.TPShard): this
    rank's share under tensor parallelism."""
    sites = []
    for path, module in model.named_modules():
        for cls, names in _WRAPPED:
            if isinstance(module, cls):
                sites += [(module, f"{path}.{name}" if path else name, name) for name in names]
    param = next(model.parameters())
    targets: dict[str, LoRATarget] = {}
    offset = 0
    for parent, path, name in sites:
        base = getattr(parent, name)
        sizes = part_sizes(model.cfg, f"{path}.weight", base.out_features)
        shapes, dims = _global_shapes(f"{path}.weight", base.in_features, sizes, shard)
        target = LoRATarget(path, base.in_features, tuple(sizes), shapes, dims, rank, offset,
                            offset + len(sizes) * rank * base.in_features)
        targets[path] = target
        offset += target.a_numel + target.b_numel
    storage = torch.zeros((num_slots, offset), dtype=param.dtype, device=param.device)
    holder = _PlanHolder()
    for parent, path, name in sites:
        t = targets[path]
        a = storage[:, t.a_offset:t.a_offset + t.a_numel].view(num_slots, t.num_parts * rank, t.in_features)
        b = storage[:, t.b_offset:t.b_offset + t.b_numel].view(num_slots, t.out_features, rank)
        setattr(parent, name, LoRALinear(getattr(parent, name), t, a, b, holder))
    return LoRAModel(model, targets, storage, holder)
