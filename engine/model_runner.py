"""Turns a `SchedulerOutput` into tensors, runs the model once, returns logits of sampled rows.

Plan once, run per layer: the slot mapping, block tables and sequence offsets are built once per
step (`engine.step_inputs`: numpy into one staging buffer, one copy to the device) and handed to
every layer in `AttentionMetadata`. Decode-only steps run padded to a bucket and replay a CUDA
graph on GPUs (`engine.cuda_graphs`).

CPU runtime: the runner packs the model's weights for oneDNN (`CausalLM.pack_weights`)
and keeps glibc from returning freed activation memory to the kernel (`keep_freed_memory`):
every step allocates and frees the same few MB-sized activations, and when glibc serves those
with fresh mmaps, page faults on first touch cost more than the attention math itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.cuda_graphs import DecodeBuckets
from engine.runner.inference import inference_mode
from engine.runner.warmup import warm_up
from engine.models.causal_lm import CausalLM
from engine.prompt_logprobs import StepRows, sliced_logits
from engine.spec_decode.verify_graphs import VerifyBuckets
from engine.step_inputs import PrevSample, StepInputs, StepTensors, max_layout_bytes

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit: bigger blocks are always mmapped
_TRIM_THRESHOLD = 1 << 30       # keep up to 1 GiB of freed heap for reuse


@functools.cache
def keep_freed_memory() -> bool:
    """Serve allocations up to 32 MiB from the heap and keep freed heap mapped (glibc only).

    Process-wide and idempotent; returns False where there is no glibc `mallopt`."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt refused the CPU allocator settings; step times may suffer from page faults")
    return ok


class ModelRunner:
    """Runs one step of the model. Inputs go up in one copy (`StepInputs`); decode-only steps run
    padded to a bucket and, on CUDA unless `enforce_eager`, replay a captured graph
    (`engine.cuda_graphs`); other steps run eagerly."""

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int,
                 device: torch.device, max_num_seqs: int = 128, max_num_batched_tokens: int = 512,
                 max_model_len: int = 2048, enforce_eager: bool | None = None, tp=None,
                 lora_slot_of: dict[str, int] | None = None, hidden_sink=None,
                 verify: tuple[int, int] | None = None) -> None:
        """`tp` (`engine.tp.launch.TPDriver`, rank 0 of a tensor-parallel group): every step's
        inputs go to the other ranks first; steps run eagerly (no padded buckets or graphs).
        `lora_slot_of` (LoRA enabled): request id -> its adapter's slot, kept current by the
        scheduler (`engine.lora.slots`); each step stages its tokens' slots from it.
        `hidden_sink(scheduled, hidden)` (an EAGLE head, `engine.spec_decode.eagle`): called after
        every forward with its final hidden states `[T, hidden]`, in the order of the step's tokens
        (graphed decode steps copy them into a buffer the graphs write; an eager step passes
        `owned=True`: the tensor is its own, nothing writes it later); None: none kept.
        `verify` (speculative decoding): (num_speculative_tokens, largest batch): verification
        steps run padded to that width too, and replay graphs (`engine.spec_decode.verify_graphs`)."""
        self.model = model
        self.tp = tp
        self.lora_slot_of = lora_slot_of
        self.kv_cache = kv_cache  # [num_blocks, num_layers, 2, block_size, KVH, D]
        self.block_size = block_size
        self.device = device
        if device.type == "cpu":
            keep_freed_memory()
            model.pack_weights()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        max_width = -(-max_model_len // block_size)
        num_groups = model.kv_groups.num_groups    # KV groups (engine.kv_groups): tables per group
        self.inputs = StepInputs(max_layout_bytes(max(max_num_batched_tokens, max_num_seqs), max_num_seqs, max_width,
                                                  num_groups), block_size, device, num_groups=num_groups)
        # Padded decode buckets: on CUDA (graphs) unless told to stay eager; on CPU only on request
        # (tests of the padding), since padding rows cost real work there.
        use_buckets = (device.type == "cuda" if enforce_eager is None else not enforce_eager) and tp is None
        self.decode_buckets = DecodeBuckets(
            self._forward_into, model.cfg.vocab_size, next(model.parameters()).dtype, block_size, device,
            min(max_num_seqs, max_num_batched_tokens), max_model_len,
            lora=lora_slot_of is not None,
            logits_rows=VerifyBuckets.logits_rows(*verify) if verify else 0, num_groups=num_groups) if use_buckets else None
        self.verify_buckets = VerifyBuckets(self.decode_buckets, *verify, max_model_len) \
            if verify and self.decode_buckets is not None else None
        self.hidden_sink = hidden_sink
        self._hidden: torch.Tensor | None = None
        # As many rows as the graphs' logits (decode and verification steps write theirs here).
        self._hidden_buf = None if hidden_sink is None or self.decode_buckets is None else torch.empty(
            self.decode_buckets.logits.shape[0], model.cfg.hidden_size, dtype=next(model.parameters()).dtype,
            device=device)

    def read_group_tables(self, tables: dict[str, tuple[tuple[int, ...], ...]]) -> None:
        """KV groups: stage each request's tables of groups 1.. from `tables` (the scheduler's
        `GroupTables.tables`, kept current as requests grow)."""
        for inputs in (self.inputs, self.decode_buckets and self.decode_buckets.inputs):
            if inputs:
                inputs.group_tables = tables

    def capture_cuda_graphs(self) -> float:
        """Capture every decode (and verification) bucket (CUDA; a no-op elsewhere). Call after the KV
        cache exists. Verification graphs first: the larger steps, whose pool the decode graphs reuse."""
        if self.decode_buckets is None or self.device.type != "cuda":
            return 0.0
        pool = torch.cuda.graph_pool_handle()
        seconds = self.verify_buckets.capture(pool) if self.verify_buckets is not None else 0.0
        return seconds + self.decode_buckets.capture(pool)

    def warm_up(self) -> float:
        """Compile every kernel variant an eager step can need now, not while serving (CUDA; a no-op
        elsewhere: `engine.runner.warmup`). Call after the KV cache exists."""
        return warm_up(self) if self.device.type == "cuda" else 0.0

    def prepare(self, scheduled, prev: PrevSample | None = None, extra: StepRows | None = None) -> StepTensors:
        """scheduled: sequence of ScheduledSeq -> the step's tensors (eager layout)."""
        return self.inputs.prepare(scheduled, prev_rows=prev,
                                   extra_logits_rows=None if extra is None else extra.rows,
                                   lora_slots=self._lora_slots(scheduled))

    def _lora_slots(self, scheduled, graphs: bool = False) -> np.ndarray | None:
        """Each seq's adapter slot (-1: none), or None when no seq has one (no LoRA work in the
        step); `graphs`: an array whenever LoRA is on (a captured graph's layout includes it)."""
        slot_of = self.lora_slot_of
        if slot_of is None or not (slot_of or graphs):
            return None
        slots = np.fromiter((slot_of.get(seq[0], -1) for seq in scheduled), np.int32, len(scheduled))
        return slots if graphs or (slots >= 0).any() else None

    @inference_mode
    def run(self, scheduled, prev: PrevSample | None = None, extra: StepRows | None = None) -> torch.Tensor:
        """Returns logits `[num_sampled_seqs, vocab]` in the model dtype (the sampler upcasts),
        rows in the order of `scheduled`; only the sampled rows go through the lm_head. Tokens
        that are `PLACEHOLDER_TOKEN_ID` are read from `prev` on the device (async scheduling).
        `extra` (prompt logprobs): more rows through the head, handed to `extra.consume` a slice
        at a time (`engine.prompt_logprobs.sliced_logits`); such a step runs eagerly.

        The logits of a bucketed decode step live in a buffer the next step overwrites: consume
        them (sample) before running the next step."""
        if self.decode_buckets is not None and extra is None:
            bucket = self.decode_buckets.bucket(scheduled)
            if bucket is not None:
                logits = self.decode_buckets.run(scheduled, bucket, prev, self._lora_slots(scheduled, graphs=True))
                if self.hidden_sink is not None:
                    self.hidden_sink(scheduled, self._hidden_buf[:len(scheduled)])
                return logits
            bucket = None if self.verify_buckets is None or prev is not None else self.verify_buckets.bucket(scheduled)
            if bucket is not None:   # a speculative step's drafts (synchronous: no tokens on the device)
                logits = self.verify_buckets.run(scheduled, bucket, self._lora_slots(scheduled, graphs=True))
                if self.hidden_sink is not None:   # the real tokens' rows, in the step's order
                    self.hidden_sink(scheduled, self.verify_buckets.real_rows(self._hidden_buf))
                return logits
        t = self.prepare(scheduled, prev, extra)
        if prev is not None:
            t.fill_from(prev.token_ids)
        if self.tp is None:
            logits = self._forward(t, extra)
        else:
            with self.tp.step(self.inputs, t.layout):   # after the fill: the others read final ids
                logits = self._forward(t, extra)
        if self.hidden_sink is not None:   # an eager forward's own output: kept, not copied (owned)
            self.hidden_sink(scheduled, self._hidden, owned=True)
            self._hidden = None
        return logits

    @torch.inference_mode()
    def run_received(self, layout) -> torch.Tensor:
        """Tensor-parallel ranks > 0: the step rank 0 sent, already in `self.inputs`; same forward."""
        return self._forward(self.inputs.tensors(layout), receiving=True)

    def _forward(self, t: StepTensors, extra: StepRows | None = None, receiving: bool = False) -> torch.Tensor:
        hidden = self.model(t.input_ids, t.positions, self.kv_cache, t.meta)      # [T, hidden]
        if self.hidden_sink is not None:
            self._hidden = hidden
        # Decode-only steps sample every row: no copy. (A step with prompt-logprob rows never takes
        # every row: `PromptLogprobsTracker.plan` keeps the counts apart, for every rank.)
        if t.layout.num_sampled != hidden.shape[0]:
            hidden = hidden[t.logits_indices]
        if extra is None and hidden.shape[0] <= self.max_num_seqs:
            return self.model.compute_logits(hidden)
        return sliced_logits(self.model.compute_logits, hidden, self.max_num_seqs, extra, keep_all=not receiving)

    def _forward_into(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, out: torch.Tensor) -> None:
        """A padded decode batch (every row samples): model and head, logits written into `out`."""
        hidden = self.model(input_ids, positions, self.kv_cache, meta)      # [bs, hidden]
        if self._hidden_buf is not None:
            self._hidden_buf[:hidden.shape[0]].copy_(hidden)
        self.model.compute_logits(hidden, out=out)
