"""Speculative verification steps padded to (batch bucket, 1 + k tokens a request); CUDA graphs of them.

A verification step (`Engine._step_speculative`) runs each decode with its drafts as a `1 + j`-token
chunk, `j <= k` (`num_speculative_tokens`), and samples every one of its rows. Its shapes vary
with the batch and with each request's draft count, so eagerly it is one kernel launch after
another from Python, which is what decode graphs (`engine.cuda_graphs`) remove for plain steps.
As vLLM does (it captures spec-decode graphs at `1 + num_speculative_tokens` query tokens a
request), every request here is padded to the fixed width `w = 1 + k`, and the batch to a bucket
of `w`-token sequences, so one graph per bucket replays every verification step of that size:
- a request with `j < k` drafts (or none) gets `k - j` padding tokens after its real ones: they
  come last in its causal chunk, so no real row attends to them; their KV slot is -1 (the write
  skips it, `StepInputs.prepare(kv_lens=)`); their rows' logits are dropped (`run`).
- padding sequences are `w` tokens of the null block (empty table, context `w`, slots -1).
- the layout is fixed by (bucket, w, the graphs' table width), so a replay reads its inputs where
  the capture read them; the unified Triton kernel picks its grid from shapes only.
Rejected drafts roll back as on the eager path: the scheduler counts only accepted tokens' KV.

Bounded: one graph per bucket of `engine.cuda_graphs.batch_size_buckets(n)` with
`n = min(max_num_seqs, max_num_batched_tokens // w)` (the scheduler never gives a step more tokens
than its budget, and `disable_by_batch_size` caps `n` further): with the defaults
(`max_num_batched_tokens` 512, `max_num_seqs` 128) and k 4, n is 102 and there are 11 graphs
(1, 2, 4, 8, 16, 32, ..., 96, 102) beside the 12 decode ones. They are captured before the decode
graphs into the same memory pool (the largest verification step, `n * w` <= 512 tokens, needs
the most, and each later graph reuses it: about an eager step of the token budget) and write
their logits into the decode graphs' one logits buffer, grown to `n * w` rows (510 x 128k vocab
in bf16: 131 MB instead of 33), since graphs replay one at a time. Batches past `n`, contexts past the graphs'
width and steps with a prefill chunk run eagerly. On CPU the same padded path runs eagerly
(`capture=False` buckets, tests only).
"""

from __future__ import annotations

import logging
import operator
import time

import numpy as np
import torch

from engine.cuda_graphs import (_BLOCKS, _TOKENS, DecodeBuckets, MAX_GRAPH_CONTEXT, batch_size_buckets, capture_graphs,
                                smallest_at_least)
from engine.scheduling.output import ScheduledSeq
from engine.step_inputs import StepInputs, max_layout_bytes

log = logging.getLogger(__name__)
_START, _SAMPLE = operator.itemgetter(2), operator.itemgetter(4)     # ScheduledSeq fields


def verify_shape(config, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int] | None:
    """(num_speculative_tokens, the largest batch a verification graph is captured for: the module
    docstring) of a `SpeculativeConfig`, or None without one."""
    if config is None:
        return None
    k = config.num_speculative_tokens
    n = min(max_num_seqs, max_num_batched_tokens // (1 + k))
    if config.disable_by_batch_size is not None:
        n = min(n, config.disable_by_batch_size - 1)
    return k, n


class VerifyBuckets:
    """Verification steps padded to a bucket of `1 + k`-token sequences; a CUDA graph per bucket
    once captured (eagerly, the same padded forward, before). Shares the decode buckets' forward,
    table width and logits buffer (size that with `logits_rows`)."""

    def __init__(self, decode: DecodeBuckets, num_speculative_tokens: int, max_batch: int,
                 max_model_len: int) -> None:
        self.decode = decode
        self.query_width = w = 1 + num_speculative_tokens
        self.batch_sizes = batch_size_buckets(max_batch) if max_batch >= 1 else []
        self.width = decode.width
        # Padding tokens sit at positions up to start + w - 1: inside the rope cache and the table.
        self.max_start = min(max_model_len, MAX_GRAPH_CONTEXT, self.width * decode.inputs.block_size) - w
        top = self.batch_sizes[-1] if self.batch_sizes else 0
        self.inputs = StepInputs(max_layout_bytes(top * w, top, self.width), decode.inputs.block_size,
                                 decode.device, growable=False)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._padding = ScheduledSeq("", (0,) * w, 0, (), w)
        self._no_lora = np.full(top, -1, np.int32) if decode._no_lora is not None else None
        self._lengths = np.zeros(0, np.int64)     # the last run's real tokens per seq

    @staticmethod
    def logits_rows(num_speculative_tokens: int, max_batch: int) -> int:
        return max_batch * (1 + num_speculative_tokens)

    def bucket(self, scheduled) -> int | None:
        """The bucket of a verification batch (every seq a decode sampling all its 1..w tokens, some
        with drafts), else None (a plain decode batch, a prefill chunk, too large or too long)."""
        bs = smallest_at_least(self.batch_sizes, len(scheduled))
        if bs is None:
            return None
        lengths = list(map(len, map(_TOKENS, scheduled)))
        if lengths != list(map(_SAMPLE, scheduled)) or max(lengths) > self.query_width or max(lengths) == 1 \
                or max(map(_START, scheduled)) > self.max_start or max(map(len, map(_BLOCKS, scheduled))) > self.width:
            return None
        return bs

    def run(self, scheduled, bucket: int, lora_slots: np.ndarray | None = None) -> torch.Tensor:
        """Logits of every real row (`sum(seq.sample)` rows, each seq's in order), as the eager step returns."""
        w, num_real = self.query_width, len(scheduled)
        lengths = np.fromiter(map(len, map(_TOKENS, scheduled)), np.int64, num_real)
        padded = [seq._replace(token_ids=seq.token_ids + (0,) * (w - n), sample=w) if n < w else seq
                  for seq, n in zip(scheduled, lengths.tolist())]
        padded += [self._padding] * (bucket - num_real)
        kv_lens = np.zeros(bucket, np.int64)
        kv_lens[:num_real] = lengths
        if lora_slots is not None:
            lora_slots = np.concatenate([lora_slots, self._no_lora[:bucket - num_real]])
        t = self.inputs.prepare(padded, width=self.width, lora_slots=lora_slots, kv_lens=kv_lens)
        logits = self.decode.logits
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self.decode.forward(t.input_ids, t.positions, t.meta, logits[:bucket * w])
        self._lengths = lengths
        return self.real_rows(logits)

    def real_rows(self, padded: torch.Tensor) -> torch.Tensor:
        """The real tokens' rows (each seq's in order, padding dropped) of a buffer laid out as the
        last `run`'s padded step, `[bucket * w, ...]`: its logits, or anything else per token."""
        lengths, w = self._lengths, self.query_width
        num_real = len(lengths)
        if (lengths == w).all():
            return padded[:num_real * w]
        total = int(lengths.sum())
        rows = np.repeat(np.arange(num_real) * w - (np.cumsum(lengths) - lengths), lengths) + np.arange(total)
        return padded.index_select(0, torch.from_numpy(rows).to(padded.device, non_blocking=True))

    def capture(self, pool=None) -> float:
        """Capture every bucket (CUDA only) into `pool`; returns the seconds it took."""
        if self.decode.device.type != "cuda" or not self.batch_sizes:
            return 0.0
        start, w = time.perf_counter(), self.query_width

        def padded(bs: int):
            lora = None if self._no_lora is None else self._no_lora[:bs]
            t = self.inputs.prepare([self._padding] * bs, width=self.width, lora_slots=lora,
                                    kv_lens=np.zeros(bs, np.int64))
            return lambda: self.decode.forward(t.input_ids, t.positions, t.meta, self.decode.logits[:bs * w])

        self.graphs.update(capture_graphs(self.decode.device, sorted(self.batch_sizes, reverse=True), padded, pool,
                                          "capturing verification CUDA graphs"))
        seconds = time.perf_counter() - start
        log.info("captured %d speculative verification CUDA graphs (batch sizes up to %d, %d tokens a request) "
                 "in %.1f s", len(self.graphs), self.batch_sizes[-1], w, seconds)
        return seconds
