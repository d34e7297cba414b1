"""Which slice of every weight and KV head a tensor-parallel rank owns (Megatron layout).

Column-parallel layers (q/k/v, gate/up, the vocab of the embedding and the head) split their
output rows; row-parallel layers (o_proj, down_proj) split their input columns and end in one
all-reduce. Query heads and the MLP's intermediate size split evenly. KV heads split evenly when
there are at least as many as ranks; with fewer, each KV head is replicated on the
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
    if cfg.intermediate_size % size:
        raise TensorParallelError(
            f"intermediate_size ({cfg.intermediate_size}) must be divisible by tensor_parallel_size ({size})")


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
        n = self.cfg.intermediate_size // self.size
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
                                   intermediate_size=len(self.intermediate))

    def split(self, name: str, index: int | None) -> tuple[int, range, int] | None:
        """How this rank reads a checkpoint tensor, by our (fused) parameter name and slice index
        (q/k/v = 0/1/2, gate/up = 0/1): `(dim, rows of that dim to read, the dim's full length)`,
        or None when the tensor is not split (norms; o_proj's bias, which rank 0 alone adds)."""
        if self.size == 1:
            return None
        cfg, d = self.cfg, self.cfg.head_dim
        if "qkv_proj" in name:
            heads, total = (self.q_heads, cfg.num_heads) if index == 0 else (self.kv_heads, cfg.num_kv_heads)
            return 0, range(heads.start * d, heads.stop * d), total * d
        if "gate_up_proj" in name:
            return 0, self.intermediate, cfg.intermediate_size
        if name in ("embed_tokens.weight", "lm_head.weight"):
            start = self.vocab.start
            return 0, range(start, start + self.vocab_rows_in_checkpoint), cfg.vocab_size
        if name.endswith("self_attn.o_proj.weight"):
            return 1, range(self.q_heads.start * d, self.q_heads.stop * d), cfg.q_size
        if name.endswith("mlp.down_proj.weight"):
            return 1, self.intermediate, cfg.intermediate_size
        return None
