"""Small frozen configs, one per component, checked in `__post_init__`.

Computed sizes (the number of KV blocks that fit in memory) go into a new object with
`dataclasses.replace`, never by mutation.
"""

from __future__ import annotations

from dataclasses import dataclass

# `--quantization` values (engine/quant.py); here, torch-free, for the CLI flags that offer them.
QUANTIZATIONS = ("int8", "fp8")
# `--kv-cache-dtype` values (engine/kv_dtype.py): the model dtype, or float8_e4m3fn with per-tensor scales.
KV_CACHE_DTYPES = ("auto", "fp8")
KV_CACHE_GROUPS = ("auto", "single")   # --kv-cache-groups (engine/kv_groups/spec.py: serving_groups)
# KV cache sizing defaults (engine/kv_sizing.py), torch-free for the CLI and `cbserve up`.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_CPU_KV_CACHE_MEMORY_BYTES = 256 << 20


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache. Its size, first set wins: `num_blocks`, `kv_cache_memory_bytes`, then on CUDA
    `gpu_memory_utilization` (None: 0.9) and on CPU 256 MiB (engine/kv_sizing.py)."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None   # share of the device's total memory; CUDA only
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"                  # "auto": the model dtype; "fp8": e4m3, per-tensor scales
    # "auto": a mixed local/global model runs a block table per KV group unless it speculates;
    # "single": one group (every layer's KV in every block), for a prefill pool whose decode pool
    # speculates, since both pods of a pull must run the same groups (the handshake compares them).
    kv_cache_groups: str = "auto"
    # Set from the model (not a flag): its window when every layer has one, so the blocks behind it
    # are freed (engine/kv_cache_manager.py); None keeps a request's blocks until it ends.
    sliding_window: int | None = None
    # Set from the model and role (not a flag): each KV group's window (0: full), when a mixed
    # local/global model runs one block table per group (engine/kv_groups/); () for one group.
    kv_group_windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.kv_cache_groups not in KV_CACHE_GROUPS:
            raise ValueError(f"kv_cache_groups must be one of {KV_CACHE_GROUPS}, got {self.kv_cache_groups!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512      # token budget per step (decodes + prefill chunks)
    max_num_seqs: int = 128
    max_model_len: int = 2048
    policy: str = "fcfs"                   # "fcfs" | "priority"
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")
