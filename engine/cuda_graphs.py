"""Decode steps replayed from CUDA graphs, one per (padded batch size, block-table width) bucket.

Why: a decode step launches ~200 small kernels from Python; at small batches the GPU finishes each
faster than the host launches the next, so the step is host-bound. A graph replays them all with
one launch.

What makes a step capturable (vLLM's recipe, read from the kernels here):
- Inputs live at fixed addresses: `StepInputs` lays every field out from (tokens, seqs, width)
  alone, so a bucket's replay writes its inputs where the capture read them.
- Kernel grids depend only on shapes: the batch is padded to the bucket's size (padding rows are
  harmless decodes of the null block, `engine.step_inputs`), and the block table to the bucket's
  width, which also fixes the split-K partition count. Triton specialises integer arguments
  (== 1, % 16), so every bucket runs eagerly once before its capture.
- The head runs inside the graph and writes into one persistent logits buffer shared by all
  buckets (the graphs replay one at a time), so graphs do not each hold a logits tensor.
- Buckets are captured widest and largest first into one memory pool, so smaller ones reuse it.

Contexts past `MAX_GRAPH_CONTEXT` tokens and mixed prefill/decode steps run eagerly. On CPU the
same padded path runs eagerly (`DecodeBuckets(capture=False)`), which is how its padding logic
is tested without a GPU.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.progress import progress
from engine.step_inputs import StepInputs, max_layout_bytes

log = logging.getLogger(__name__)

MAX_GRAPH_CONTEXT = 8192     # tokens; longer decodes are weight-read-bound enough to run eagerly
MIN_GRAPH_CONTEXT = 256


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including `max_num_seqs`."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def width_buckets(max_model_len: int, block_size: int) -> list[int]:
    """Block-table widths (in blocks): contexts of 256, 512, ... tokens up to
    min(max_model_len, MAX_GRAPH_CONTEXT)."""
    limit = min(max_model_len, MAX_GRAPH_CONTEXT)
    tokens, widths = MIN_GRAPH_CONTEXT, []
    while tokens < limit:
        widths.append(-(-tokens // block_size))
        tokens *= 2
    widths.append(-(-limit // block_size))
    return sorted(set(widths))


def smallest_at_least(buckets: list[int], value: int) -> int | None:
    for b in buckets:
        if b >= value:
            return b
    return None


class DecodeBuckets:
    """Runs decode-only steps padded to a bucket; replays a CUDA graph per bucket once captured.

    `forward(input_ids, positions, meta, out)` runs the model plus head for a padded batch and
    writes logits `[bs, vocab]` into `out` (the runner supplies it)."""

    def __init__(self, forward, vocab_size: int, dtype: torch.dtype, block_size: int, device: torch.device,
                 max_num_seqs: int, max_model_len: int, lora: bool = False) -> None:
        """`lora`: every step stages its tokens' LoRA slots (engine/lora/), so graphs include the
        LoRA kernels (rows without an adapter skip them on the device)."""
        self.forward = forward
        self._no_lora = np.empty(0, np.int32) if lora else None
        self.device = device
        self.batch_sizes = batch_size_buckets(max_num_seqs)
        self.widths = width_buckets(max_model_len, block_size)
        self.inputs = StepInputs(max_layout_bytes(self.batch_sizes[-1], self.batch_sizes[-1], self.widths[-1]),
                                 block_size, device, growable=False)
        self.logits = torch.empty(self.batch_sizes[-1], vocab_size, dtype=dtype, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def bucket(self, scheduled) -> tuple[int, int] | None:
        """(batch size, width) for a decode-only batch that fits a bucket, else None."""
        bs = smallest_at_least(self.batch_sizes, len(scheduled))
        if bs is None:
            return None
        max_blocks = 0
        for seq in scheduled:
            if len(seq[1]) != 1:          # a prefill chunk: not a decode-only step
                return None
            n = len(seq[3])
            if n > max_blocks:
                max_blocks = n
        width = smallest_at_least(self.widths, max_blocks)
        return None if width is None else (bs, width)

    def run(self, scheduled, bucket: tuple[int, int], prev=None, lora_slots=None) -> torch.Tensor:
        """Logits `[len(scheduled), vocab]` of a decode-only batch, padded to `bucket`."""
        bs, width = bucket
        t = self.inputs.prepare(scheduled, pad_to=bs, width=width,
                                prev_rows=None if prev is None else prev.rows, lora_slots=lora_slots)
        if t.fill_dst.numel():
            t.input_ids.index_copy_(0, t.fill_dst, prev.token_ids.index_select(0, t.fill_src))
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self.forward(t.input_ids, t.positions, t.meta, self.logits[:bs])
        return self.logits[:t.num_seqs]

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket (CUDA only); returns the seconds it took."""
        if self.device.type != "cuda":
            return 0.0
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()   # capture runs on a side stream, as torch requires
        bar = progress(desc="capturing decode CUDA graphs", total=len(self.widths) * len(self.batch_sizes),
                       unit="graph")
        for width in sorted(self.widths, reverse=True):
            for bs in sorted(self.batch_sizes, reverse=True):
                t = self.inputs.prepare([], pad_to=bs, width=width, lora_slots=self._no_lora)   # all padding
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):   # compile and specialise every kernel for this shape
                        self.forward(t.input_ids, t.positions, t.meta, self.logits[:bs])
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.forward(t.input_ids, t.positions, t.meta, self.logits[:bs])
                self.graphs[(bs, width)] = graph
                bar.update(1)
        bar.close()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        log.info("captured %d decode CUDA graphs (batch sizes up to %d, contexts up to %d blocks) in %.1f s",
                 len(self.graphs), self.batch_sizes[-1], self.widths[-1], seconds)
        return seconds


def graph_memory_estimate(hidden_size: int, intermediate_size: int, vocab_size: int, max_num_seqs: int,
                          element_size: int) -> int:
    """Bytes the graphs' pool and logits buffer take, for KV sizing: the largest bucket's live
    activations (a few hidden- and intermediate-sized rows per sequence, with slack for the
    attention partials) plus the shared logits buffer, doubled for allocator rounding."""
    activations = max_num_seqs * (8 * hidden_size + 4 * intermediate_size) * element_size
    logits = max_num_seqs * vocab_size * element_size
    return 2 * (activations + logits) + (64 << 20)
