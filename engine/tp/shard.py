"""Which slice of every weight and KV head a tensor-parallel rank owns (Megatron layout).

Column-parallel layers (q/k/v, gate/up, the vocab of the embedding and the head) split their
output rows; row-parallel layers (o_proj, down_proj) split their input columns and end in one
all-reduce. Query heads and the MLP's intermediate size split evenly; so does every expert of a
mixture of experts (its gate/up rows and down columns, as a dense MLP's; routers are replicated).
KV heads split evenly when there are at least as many as ranks; with fewer, each KV head is replicated on the
`size // num_kv_heads` consecutive ranks whose query heads read it (rank r keeps KV head
`r * num_kv_heads // size`), so every rank still holds exactly one KV head's cache. The vocabulary
splits into equal padded shards (the last rank's tail rows are zeros, dropped after the gather).

Pure arithmetic over ints, torch-free: the loader, the model and the CLI checks share it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.model_config import ModelConfig


class TensorParallelError(ValueError):
    """A model whose shape cannot be split over the requested number of ranks, or a lost rank."""


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Raise `TensorParallelError` naming the field when `cfg` cannot run at `size` ranks."""
    if size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {size}")
    if cfg.num_heads % size:
        raise TensorParallelError(
            f"num_attention_heads ({cfg.num_heads}) must be divisible by tensor_parallel_size ({size})")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise TensorParallelError(
            f"num_key_value_heads ({cfg.num_kv_heads}) and tensor_parallel_size ({size}) must divide "
            "one another (KV heads are split, or replicated when there are fewer than ranks)")
    dense = cfg.intermediate_size if cfg.num_dense_layers else 0   # unused when every layer is MoE
    for field, value in (("intermediate_size", dense),
                         ("moe_intermediate_size", cfg.moe_intermediate_size),
                         ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)):
        if value % size:
            raise TensorParallelError(
                f"{field} ({value}) must be divisible by tensor_parallel_size ({size})")


@dataclass(frozen=True)
class SplitPlan:
    """Read `ranges` of dim `dim` of a checkpoint tensor (whose `dim` is `length` long), joined
    in order: one range, or two for a packed gate/up tensor (this rank's gate rows and up rows)."""

    dim: int
    ranges: tuple[range, ...]
    length: int


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size` over the model `cfg` (the global, unsplit config)."""

    cfg: ModelConfig
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        check_divisible(self.cfg, self.size)
        if not 0 <= self.rank < self.size:
            raise TensorParallelError(f"rank {self.rank} is outside [0, {self.size})")

    # -- heads and features, as [start, stop) ranges in the global tensors
    @property
    def q_heads(self) -> range:
        n = self.cfg.num_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def kv_heads(self) -> range:
        kvh = self.cfg.num_kv_heads
        if kvh >= self.size:
            n = kvh // self.size
            return range(self.rank * n, (self.rank + 1) * n)
        head = self.rank * kvh // self.size    # replicated: the head this rank's queries read
        return range(head, head + 1)

    @property
    def intermediate(self) -> range:
        return self._share(self.cfg.intermediate_size)

    @property
    def moe_intermediate(self) -> range:
        """Each expert's intermediate rows (every rank holds a slice of every expert)."""
        return self._share(self.cfg.moe_intermediate_size)

    @property
    def shared_expert_intermediate(self) -> range:
        return self._share(self.cfg.shared_expert_intermediate_size)

    def _share(self, total: int) -> range:
        n = total // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.cfg.vocab_size // self.size)

    @property
    def vocab(self) -> range:
        """This rank's padded vocab rows; `vocab_rows_in_checkpoint` of them exist in the files."""
        return range(self.rank * self.vocab_per_rank, (self.rank + 1) * self.vocab_per_rank)

    @property
    def vocab_rows_in_checkpoint(self) -> int:
        return max(0, min(self.vocab.stop, self.cfg.vocab_size) - self.vocab.start)

    def local_config(self) -> ModelConfig:
        """The config of this rank's share: fewer heads and a narrower MLP; vocab stays global
        (the sampler and request checks read it; the embedding sizes itself from `vocab`)."""
        if self.size == 1:
            return self.cfg
        return dataclasses.replace(self.cfg, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads),
                                   intermediate_size=len(self.intermediate),
                                   moe_intermediate_size=len(self.moe_intermediate),
                                   shared_expert_intermediate_size=len(self.shared_expert_intermediate))

    def split(self, name: str, part: int | None, per_expert: bool = True) -> SplitPlan | None:
        """How this rank reads a checkpoint tensor, by our (fused) parameter name and part index
        (q/k/v = 0/1/2, gate/up = 0/1; None: the whole tensor); `per_expert`: an expert parameter's
        tensor holds one expert (2-D) rather than all of them (3-D, the packed layout). None when
        the tensor is not split (norms, routers; o_proj's bias, which rank 0 alone adds)."""
        if self.size == 1:
            return None
        cfg, d = self.cfg, self.cfg.head_dim
        if "qkv_proj" in name:
            heads, total = (self.q_heads, cfg.num_heads) if part == 0 else (self.kv_heads, cfg.num_kv_heads)
            return SplitPlan(0, (range(heads.start * d, heads.stop * d),), total * d)
        if name in ("embed_tokens.weight", "lm_head.weight"):
            start = self.vocab.start
            return SplitPlan(0, (range(start, start + self.vocab_rows_in_checkpoint),), cfg.vocab_size)
        if name.endswith("self_attn.o_proj.weight"):
            return SplitPlan(1, (range(self.q_heads.start * d, self.q_heads.stop * d),), cfg.q_size)
        if name.endswith("self_attn.sinks"):                 # gpt-oss: one logit per query head
            return SplitPlan(0, (self.q_heads,), cfg.num_heads)
        rows, total = self._intermediate_of(name)
        if name.endswith("experts.gate_up_proj"):
            if per_expert:                                   # [I, H] of one expert's gate or up
                return SplitPlan(0, (rows,), total)
            up = range(total + rows.start, total + rows.stop)   # [E, 2I, H]: the gate rows, then the up rows
            return SplitPlan(1, (rows, up), 2 * total)
        if name.endswith("experts.down_proj"):
            return SplitPlan(1 if per_expert else 2, (rows,), total)
        if name.endswith("experts.gate_up_proj_bias"):       # gpt-oss: [E, 2I], split as the rows it adds to
            return SplitPlan(1, (rows, range(total + rows.start, total + rows.stop)), 2 * total)
        if name.endswith("gate_up_proj.weight"):
            return SplitPlan(0, (rows,), total)
        if name.endswith("down_proj.weight"):
            return SplitPlan(1, (rows,), total)
        return None

    def _intermediate_of(self, name: str) -> tuple[range, int]:
        # (this rank's rows, the global size) of the intermediate dim of the MLP that `name` is in.
        if ".shared_expert." in name:
            return self.shared_expert_intermediate, self.cfg.shared_expert_intermediate_size
        if ".experts." in name:
            return self.moe_intermediate, self.cfg.moe_intermediate_size
        return self.intermediate, self.cfg.intermediate_size
