"""Decode steps replayed from CUDA graphs, one per padded batch size.

Why: a decode step launches ~200 small kernels from Python; at small batches the GPU finishes each
faster than the host launches the next, so the step is host-bound. A graph replays them all with
one launch.

What makes a step capturable (vLLM's recipe, read from the kernels here):
- Inputs live at fixed addresses: `StepInputs` lays every field out from (tokens, seqs, width)
  alone, so a bucket's replay writes its inputs where the capture read them.
- Kernel grids depend only on shapes: the batch is padded to the bucket's size (padding rows are
  harmless decodes of the null block, `engine.step_inputs`), and the block table to one width for
  every graph, the longest graph context (`graph_width`), which also fixes the split-K partition
  count. So the graphs are keyed by batch size alone (as in vLLM, SGLang and nano-vllm), every
  graph runs the same kernel variants, and the kernels read each row's real length on the device
  (partitions past it exit at once). Triton specialises integer arguments (== 1, % 16) unless
  told not to: the batch-dependent ones are in the kernels' `do_not_specialize`, and every bucket
  runs eagerly once before its capture anyway.
- The head runs inside the graph and writes into one persistent logits buffer shared by all
  buckets (the graphs replay one at a time), so graphs do not each hold a logits tensor.
- Buckets are captured largest first into one memory pool, so smaller ones reuse it.
- The kernels must be Triton's: the torch reference reads lengths back to the host, which a
  capture cannot do, so graphs refuse to start on another backend (`check_graph_backend`).

Contexts past `MAX_GRAPH_CONTEXT` tokens and mixed prefill/decode steps run eagerly, and so does
every step of a prefill-role engine (`wants_decode_graphs`): its requests end at their first
token, so it never runs the decode steps graphs are for. On CPU the same padded path runs eagerly
(`DecodeBuckets(capture=False)`), which is how its padding logic is tested without a GPU.
"""

from __future__ import annotations

import logging
import operator
import time

import numpy as np
import torch

from engine.progress import progress
from engine.scheduling.output import DecodeSeqs
from engine.step_inputs import StepInputs, max_layout_bytes

log = logging.getLogger(__name__)

MAX_GRAPH_CONTEXT = 8192     # tokens; longer decodes are weight-read-bound enough to run eagerly
_TOKENS, _BLOCKS = operator.itemgetter(1), operator.itemgetter(3)     # ScheduledSeq fields


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including `max_num_seqs`."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def graph_width(max_model_len: int, block_size: int) -> int:
    """The block-table width (in blocks) of every graph: min(max_model_len, MAX_GRAPH_CONTEXT) tokens."""
    return -(-min(max_model_len, MAX_GRAPH_CONTEXT) // block_size)


def smallest_at_least(buckets: list[int], value: int) -> int | None:
    for b in buckets:
        if b >= value:
            return b
    return None


def wants_decode_graphs(device: torch.device, role: str, enforce_eager: bool, tensor_parallel_size: int) -> bool:
    """Whether an engine captures decode graphs: on CUDA, one rank, not `--enforce-eager`, and not the
    prefill role (which never runs a decode step it could replay: its requests end at their first
    token), so a prefill engine neither captures them nor keeps memory back for them."""
    return device.type == "cuda" and not enforce_eager and tensor_parallel_size == 1 and role != "prefill"


def check_graph_backend(device: torch.device) -> None:
    """Refuse CUDA graphs over the torch reference kernels (CBSERVE_KERNEL_BACKEND=torch, or triton
    failing to import): they read sequence lengths back to the host, which stops a capture with an
    error far from its cause."""
    from kernels import backend

    chosen = backend.select_backend(torch.empty(0, device=device))
    if chosen != backend.TRITON:
        if backend.forced_backend() is not None:
            why = f"{backend.ENV_VAR}={backend.forced_backend()}"
        elif not backend.triton_available():
            why = "triton cannot be imported"
        else:
            why = f"the torch kernels serve {device.type} tensors"
        raise RuntimeError(f"CUDA graphs need the Triton kernels, but the kernel backend on {device} is "
                           f"{chosen} ({why}): install triton, set {backend.ENV_VAR}=triton, or pass "
                           f"--enforce-eager to run without CUDA graphs")


class DecodeBuckets:
    """Runs decode-only steps padded to a bucket; replays a CUDA graph per bucket once captured.

    `forward(input_ids, positions, meta, out)` runs the model plus head for a padded batch and
    writes logits `[bs, vocab]` into `out` (the runner supplies it)."""

    def __init__(self, forward, vocab_size: int, dtype: torch.dtype, block_size: int, device: torch.device,
                 max_num_seqs: int, max_model_len: int, lora: bool = False, logits_rows: int = 0,
                 num_groups: int = 1) -> None:
        """`lora`: every step stages its tokens' LoRA slots (engine/lora/), so graphs include the
        LoRA kernels (rows without an adapter skip them on the device). `logits_rows`: rows the
        shared logits buffer needs beyond the largest bucket (speculative verification graphs,
        `engine.spec_decode.verify_graphs`, write theirs into it too). `num_groups`: KV groups
        (`engine.kv_groups`), each with its tables and slots among the graphs' inputs."""
        if device.type == "cuda":
            check_graph_backend(device)
        self.forward = forward
        self._no_lora = np.empty(0, np.int32) if lora else None
        self.device = device
        self.batch_sizes = batch_size_buckets(max_num_seqs)
        self.width = graph_width(max_model_len, block_size)
        self.inputs = StepInputs(max_layout_bytes(self.batch_sizes[-1], self.batch_sizes[-1], self.width, num_groups),
                                 block_size, device, growable=False, num_groups=num_groups)
        self.logits = torch.empty(max(self.batch_sizes[-1], logits_rows), vocab_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._rows: dict[int, torch.Tensor] = {}     # `_logits_rows`

    def bucket(self, scheduled) -> int | None:
        """The padded batch size for a decode-only batch that fits the graphs' width, else None."""
        bs = smallest_at_least(self.batch_sizes, len(scheduled))
        if bs is None:
            return None
        if isinstance(scheduled, DecodeSeqs):     # decodes by construction (engine.decode_columns)
            return bs if scheduled.width <= self.width else None
        # C-level passes: every seq has one new token, and no table is wider than the graphs'.
        if sum(map(len, map(_TOKENS, scheduled))) != len(scheduled) or \
                max(map(len, map(_BLOCKS, scheduled)), default=0) > self.width:
            return None
        return bs

    def run(self, scheduled, bucket: int, prev=None, lora_slots=None) -> torch.Tensor:
        """Logits `[len(scheduled), vocab]` of a decode-only batch, padded to `bucket` sequences."""
        t = self.inputs.prepare(scheduled, pad_to=bucket, width=self.width,
                                prev_rows=prev, lora_slots=lora_slots)
        if prev is not None:
            t.fill_from(prev.token_ids)
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self.forward(t.input_ids, t.positions, t.meta, self._logits_rows(bucket))
        return self._logits_rows(t.num_seqs)

    def _logits_rows(self, n: int) -> torch.Tensor:
        """`self.logits[:n]`, one view per size (a slice costs more than a small step's copy)."""
        rows = self._rows.get(n)
        if rows is None:
            rows = self._rows[n] = self.logits[:n]
        return rows

    def capture(self, pool=None) -> float:
        """Capture every bucket (CUDA only) into `pool` (default: a new one); returns the seconds it took."""
        if self.device.type != "cuda":
            return 0.0
        start = time.perf_counter()

        def padded(bs: int):   # all padding, staged before the graph, not in it
            t = self.inputs.prepare([], pad_to=bs, width=self.width, lora_slots=self._no_lora)
            return lambda: self.forward(t.input_ids, t.positions, t.meta, self.logits[:bs])

        self.graphs.update(capture_graphs(self.device, sorted(self.batch_sizes, reverse=True), padded, pool,
                                          "capturing decode CUDA graphs"))
        seconds = time.perf_counter() - start
        log.info("captured %d decode CUDA graphs (batch sizes up to %d, contexts up to %d blocks) in %.1f s",
                 len(self.graphs), self.batch_sizes[-1], self.width, seconds)
        return seconds


@torch.inference_mode()
def capture_graphs(device: torch.device, keys: list, padded, pool=None, desc: str = "capturing CUDA graphs") -> dict:
    """One CUDA graph per key, in the order given (largest first, so later ones reuse the pool's
    memory), into `pool` (default: a new one). `padded(key)` stages the key's inputs and returns
    the forward to capture; it runs twice eagerly on a side stream first (compiles, specialises)."""
    graphs = {}
    with torch.cuda.device(device):   # the pool, the streams and the capture: this engine's device
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        stream = torch.cuda.Stream(device)   # warm-ups run on a side stream, as torch requires
        current = torch.cuda.current_stream(device)
        bar = progress(desc=desc, total=len(keys), unit="graph")
        for key in keys:
            forward = padded(key)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for _ in range(2):   # compile and specialise every kernel for this shape
                    forward()
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                forward()
            graphs[key] = graph
            bar.update(1)
        bar.close()
        torch.cuda.synchronize(device)
    return graphs


def graph_memory_estimate(hidden_size: int, intermediate_size: int, vocab_size: int, max_num_seqs: int,
                          element_size: int) -> int:
    """Bytes the graphs' pool and logits buffer take, for KV sizing: the largest bucket's live
    activations (a few hidden- and intermediate-sized rows per sequence, with slack for the
    attention partials) plus the shared logits buffer, doubled for allocator rounding."""
    activations = max_num_seqs * (8 * hidden_size + 4 * intermediate_size) * element_size
    logits = max_num_seqs * vocab_size * element_size
    return 2 * (activations + logits) + (64 << 20)
