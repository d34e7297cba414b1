"""How many KV blocks fit: an explicit size, or what the loaded model leaves of a device share.

Precedence: `num_blocks`, then `kv_cache_memory_bytes`, then on CUDA `gpu_memory_utilization`
(vLLM's `--gpu-memory-utilization`, default 0.9), and on CPU `DEFAULT_CPU_KV_CACHE_MEMORY_BYTES`.

The CUDA rule (vLLM's), measured once after the weights load, with one profiling step:

    kv_bytes = util * total - peak_torch_allocated - non_torch_increase - headroom

`peak_torch_allocated` is `max_memory_allocated()` over a forward of `max_num_batched_tokens`
tokens plus the sampler's worst case, so it holds the weights and the largest activations;
`non_torch_increase` is what the CUDA driver handed out that torch does not own (cuBLAS and Triton
workspaces: `total - free - memory_reserved()`), counted from the startup snapshot so another pod
on the same device is not charged to this one; `headroom` covers what arrives after startup
(CUDA graphs, NCCL). The startup check (free >= util * total) is what makes the share safe.

The arithmetic is pure (`MemorySnapshot` in, bytes out) and tested on CPU with made-up numbers;
`profile_peak_memory` runs the profiling step on any device and measures it on CUDA only.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from engine.attention_metadata import AttentionMetadata
from engine.config import DEFAULT_CPU_KV_CACHE_MEMORY_BYTES, DEFAULT_GPU_MEMORY_UTILIZATION, CacheConfig
from engine.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for_memory
from engine.kv_groups.spec import cache_groups, num_pages
from engine.models.causal_lm import CausalLM
from engine.progress import stage
from engine.sampling.sampler import Sampler, SamplerOutput
from engine.sampling.params import MAX_LOGPROBS, SamplingParams

log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
# An estimate, not a measurement: decode CUDA graphs are captured after the KV cache is allocated,
# into one pool shared by every bucket (about the largest decode step's activations; vLLM sees a
# few hundred MiB for 8B-class models), with the runner's persistent step inputs and logits. The
# engine passes `engine.cuda_graphs.graph_memory_estimate` for its shape (0 when eager); this is
# the default for callers that do not know the shape.
CUDA_GRAPH_POOL_BYTES = 512 * MiB
# NCCL (`--kv-transport nccl`) creates one communicator per prefill/decode pair after startup
# (kvtransfer/collective.py): its channel buffers plus the torch payload tensors of in-flight runs.
NCCL_BYTES = 1 * GiB


@dataclass(frozen=True)
class MemorySnapshot:
    """One device's memory, in bytes, as `torch.cuda` reports it."""

    total: int                        # mem_get_info()[1]
    free: int                         # mem_get_info()[0]
    torch_reserved: int = 0           # memory_reserved(): torch's caching allocator
    torch_peak_allocated: int = 0     # max_memory_allocated() since the last reset

    @property
    def non_torch(self) -> int:
        """Used on the device but not by torch's allocator (CUDA context, workspaces, other processes)."""
        return max(0, self.total - self.free - self.torch_reserved)


@dataclass(frozen=True)
class KVBudget:
    """The terms of the CUDA rule, kept for the startup log and the error messages."""

    requested: int            # util * total
    peak_torch: int           # weights + the profiling step's activations
    non_torch_increase: int
    headroom: int

    @property
    def kv_bytes(self) -> int:
        return self.requested - self.peak_torch - self.non_torch_increase - self.headroom

    def describe(self) -> str:
        return (f"{_gib(self.requested)} requested - {_gib(self.peak_torch)} peak torch (weights + "
                f"activations) - {_gib(self.non_torch_increase)} non-torch - {_gib(self.headroom)} "
                f"headroom = {_gib(self.kv_bytes)} for the KV cache")


def headroom_bytes(cuda_graph_pool_bytes: int = CUDA_GRAPH_POOL_BYTES, nccl_bytes: int = NCCL_BYTES) -> int:
    """Device memory kept out of the KV cache for what is allocated after startup."""
    return cuda_graph_pool_bytes + nccl_bytes


def check_startup_memory(startup: MemorySnapshot, utilization: float) -> None:
    """Refuse a share the device cannot give now (another process holds the rest)."""
    requested = int(utilization * startup.total)
    if startup.free < requested:
        raise RuntimeError(
            f"--gpu-memory-utilization {utilization:g} asks for {_gib(requested)} of the device's "
            f"{_gib(startup.total)}, but only {_gib(startup.free)} is free at startup (another process "
            f"holds the rest): lower --gpu-memory-utilization to at most "
            f"{startup.free / startup.total:.3f}, or set --kv-cache-memory-mb / --num-blocks")


def kv_budget(startup: MemorySnapshot, profiled: MemorySnapshot, utilization: float,
              headroom: int | None = None) -> KVBudget:
    """The CUDA rule's terms (module docstring): `startup` before the weights load, `profiled`
    right after the profiling step (its `torch_peak_allocated` covers the step); `headroom`
    defaults to `headroom_bytes()`."""
    return KVBudget(requested=int(utilization * profiled.total), peak_torch=profiled.torch_peak_allocated,
                    non_torch_increase=max(0, profiled.non_torch - startup.non_torch),
                    headroom=headroom_bytes() if headroom is None else headroom)


def num_blocks_for_budget(budget: KVBudget, block_bytes: int, utilization: float) -> int:
    """Blocks that fit in the budget; refuses a budget without room for two (block 0 is the null block)."""
    num_blocks = max(0, budget.kv_bytes) // block_bytes
    if num_blocks < 2:
        raise RuntimeError(
            f"no room for the KV cache at --gpu-memory-utilization {utilization:g}: {budget.describe()} "
            f"(one block is {block_bytes / MiB:.2f} MiB, at least 2 are needed): raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens / --max-num-seqs, or set "
            f"--kv-cache-memory-mb / --num-blocks")
    return num_blocks


# ---------------------------------------------------------------------------------- measuring
def device_memory(device: torch.device) -> MemorySnapshot:
    """The device's memory now (CUDA only): free/total from the driver, torch's reservation."""
    free, total = torch.cuda.mem_get_info(device)
    return MemorySnapshot(total=total, free=free, torch_reserved=torch.cuda.memory_reserved(device),
                          torch_peak_allocated=torch.cuda.max_memory_allocated(device))


@dataclass(frozen=True)
class ProfileBatch:
    """The profiling step's shape: `num_tokens` prompt tokens over `len(query_lens)` sequences."""

    query_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @classmethod
    def worst_case(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> ProfileBatch:
        """The largest step the scheduler can plan: the token budget, spread evenly over as many
        sequences as it may run (a step never has more sequences than tokens, nor a sequence
        longer than `max_model_len`). Every sequence samples: that is also the sampler's worst case."""
        num_tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
        num_seqs = min(max_num_seqs, num_tokens)
        base, extra = divmod(num_tokens, num_seqs)
        return cls(tuple(base + (i < extra) for i in range(num_seqs)))


@dataclass(frozen=True)
class _ProfileRequest:
    """What the sampler reads from a request."""

    sampling_params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...] = ()


# The sampler's most expensive settings: penalties and min_tokens copy the logits, top-p sorts
# every row, seeded rows draw noise over the whole vocabulary, logprobs take a log_softmax and topk.
# Seeded, a top-k past the slice path (a whole-row sort and, on devices, an int64 rank tensor),
# top-p, penalties and logprobs: every full-vocabulary temporary the sampler can make at once.
_WORST_CASE_PARAMS = SamplingParams(temperature=1.0, top_p=0.9, top_k=1000, seed=0, repetition_penalty=1.1,
                                    min_tokens=1, logprobs=MAX_LOGPROBS)


@torch.inference_mode()
def run_profile_step(model: CausalLM, kv_cache: torch.Tensor, batch: ProfileBatch,
                     sampler: Sampler) -> SamplerOutput:
    """One forward of `batch` and one worst-case sample of every sequence's last token.

    Writes nothing into `kv_cache` (every slot is -1) and reads only block 0 (every block-table
    entry), so any cache with a block 0 will do: the profile needs no real KV cache."""
    device = kv_cache.device
    block_size = kv_cache.shape[3]
    q_lens = torch.tensor(batch.query_lens, dtype=torch.int64)                          # [S]
    query_start_loc = torch.zeros(batch.num_seqs + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    seq_index = torch.repeat_interleave(torch.arange(batch.num_seqs), q_lens)          # [T]
    positions = torch.arange(batch.num_tokens) - query_start_loc[seq_index]            # [T]: no context
    max_query_len = max(batch.query_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.full((batch.num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc.to(torch.int32).to(device),
        seq_lens=q_lens.to(torch.int32).to(device),
        block_tables=torch.zeros(batch.num_seqs, -(-max_query_len // block_size), dtype=torch.int32,
                                 device=device),
    )
    vocab = model.cfg.vocab_size
    input_ids = (torch.arange(batch.num_tokens) % vocab).to(device)                    # [T]
    meta = dataclasses.replace(meta, group_metas=(meta,) * (model.kv_groups.num_groups - 1))  # as harmless
    hidden = model(input_ids, positions.to(device), kv_cache, meta)                    # [T, hidden]
    logits = model.compute_logits(hidden[(query_start_loc[1:] - 1).to(device)])       # [S, vocab]
    requests = [_ProfileRequest(_WORST_CASE_PARAMS, tuple(range(n))) for n in batch.query_lens]
    return sampler.sample(logits, requests)


@dataclass(frozen=True)
class Profile:
    batch: ProfileBatch
    memory: MemorySnapshot | None     # right after the step (peak over it); None off CUDA


def profile_peak_memory(model: CausalLM, batch: ProfileBatch, block_size: int, dtype: torch.dtype,
                        device: torch.device, sampler: Sampler) -> Profile:
    """Run the profiling step on `device` (with a one-block scratch KV cache) and, on CUDA, the
    peak torch allocation over it and the memory left after it. Off CUDA the step still runs (the
    path is the same) but there is nothing to measure."""
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    scratch = allocate_kv_cache(model.cfg, 1, block_size, dtype, device)
    run_profile_step(model, scratch, batch, sampler)
    if not on_cuda:
        return Profile(batch, None)
    torch.cuda.synchronize(device)
    memory = device_memory(device)
    torch.cuda.empty_cache()   # the activations' blocks go back to the driver, for the KV cache
    return Profile(batch, memory)


# ---------------------------------------------------------------------------------- the engine's entry
def wants_profile(cache: CacheConfig, device: torch.device) -> bool:
    """True when the size comes from device memory (CUDA and no explicit size)."""
    return device.type == "cuda" and cache.num_blocks is None and cache.kv_cache_memory_bytes is None


def measure_startup_memory(cache: CacheConfig, device: torch.device) -> MemorySnapshot | None:
    """Call before loading the weights: the snapshot `size_cache` needs when `wants_profile`
    (else None), after refusing a share the device cannot give now."""
    if not wants_profile(cache, device):
        return None
    startup = device_memory(device)
    check_startup_memory(startup, cache.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION)
    return startup


def size_cache(cache: CacheConfig, model: CausalLM, dtype: torch.dtype, device: torch.device,
               batch: ProfileBatch, sampler: Sampler, startup: MemorySnapshot | None,
               headroom: int | None = None) -> CacheConfig:
    """`cache` with `num_blocks` set (a new object), by the precedence in the module docstring.

    `dtype` is the KV cache's (1 byte per element for fp8, `--kv-cache-dtype`);
    `startup` is `measure_startup_memory(cache, device)`, taken before the weights loaded;
    `headroom` (default `headroom_bytes()`) is kept for what is allocated after sizing."""
    groups = cache_groups(model.cfg.layer_windows, model.cfg.num_layers, cache.kv_group_windows)
    slots = groups.slots
    block_bytes = bytes_per_block(model.cfg, cache.block_size, dtype, slots)
    if cache.num_blocks is not None:
        # KV groups: a page holds `slots` layers; --num-blocks keeps meaning whole-model blocks' memory.
        num_blocks, source = num_pages(cache.num_blocks, model.cfg.num_layers, groups), "--num-blocks"
    elif not wants_profile(cache, device):
        memory = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_MEMORY_BYTES
        num_blocks = num_blocks_for_memory(model.cfg, cache.block_size, dtype, memory, slots)
        source = f"{memory / MiB:g} MiB" + ("" if cache.kv_cache_memory_bytes else " (the CPU default)")
    else:
        util = cache.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        if startup is None:
            raise ValueError("size_cache needs measure_startup_memory(), taken before the weights loaded")
        with stage(f"profiling KV cache ({batch.num_tokens} tokens, {batch.num_seqs} sequences)"):
            profile = profile_peak_memory(model, batch, cache.block_size, dtype, device, sampler)
        budget = kv_budget(startup, profile.memory, util, headroom)
        num_blocks = num_blocks_for_budget(budget, block_bytes, util)
        source = (f"--gpu-memory-utilization {util:g}: {budget.describe()}, profiled with "
                  f"{batch.num_tokens} tokens over {batch.num_seqs} sequences")
    log.info("KV cache: %d blocks x %d tokens = %d tokens (%s; %s)", num_blocks, cache.block_size,
             num_blocks * cache.block_size, _gib(num_blocks * block_bytes), source)
    return dataclasses.replace(cache, num_blocks=num_blocks)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"
