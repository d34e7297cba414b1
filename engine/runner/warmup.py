"""The start-up warm-up: one eager step of every kind the engine can run, before the first request.

Why: Triton compiles a kernel the first time it meets a new specialisation (its constexprs, the
16-byte alignment of its pointers, the integers it keys on), and a compile takes seconds. The
staging buffer aligns every input (`engine.step_inputs`) and the batch-dependent integers are out
of the kernels' keys (`do_not_specialize`), so what is left to vary is a handful of variants fixed
by the kind of step, not its size:
- a step with prefill tokens (the unified kernel's prefill tiles and decode programs);
- a decode-only step (the unified kernel's decode shape, or split-K for few sequences with long
  contexts, whose partition count rounds to a power of two in its merge kernel).
CUDA graphs warm up their own buckets before capture (`engine.cuda_graphs`); the steps here cover
what runs eagerly around them: one mixed step, and decodes at every power-of-two context the
eager path can see (kernel choices change with the context at most there, for power-of-two block
sizes and partitions), one of them a full batch; with LoRA on, the mixed step once more with its
tokens in slot 0 (the LoRA kernels key on module shapes, not on the batch). Together with the
graphs that is every variant a step can need, so no step while serving waits for a compile (`tests/engine/test_kernel_variants.py`
checks that on CPU, by recording what reaches Triton's key across a sweep of batches).

The steps use only block 0 (the null block, never a request's; only padding rows read it and their
outputs are dropped), so they need no free blocks and touch no request's KV.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.scheduling.output import ScheduledSeq

log = logging.getLogger(__name__)

_PREFILL_CHUNK = 64    # tokens of the warm-up's prefill chunk: several query tiles, within any budget


def _decode(request_id: str, context: int, block_size: int) -> ScheduledSeq:
    """A decode whose context (its new token included) is `context` tokens, all in block 0."""
    return ScheduledSeq(request_id, (0,), context - 1, (0,) * -(-context // block_size), True)


def warm_up_batches(block_size: int, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                    graph_width: int | None = None) -> list[list[ScheduledSeq]]:
    """The warm-up's steps (module docstring). `graph_width`: the decode graphs' block-table width
    (their contexts are warmed by the capture), None without graphs."""
    batches = []
    chunk = min(max_num_batched_tokens - 1, max_model_len, _PREFILL_CHUNK)
    if chunk >= 2:   # a step with prefill tokens: num_tokens > num_seqs
        prefill = ScheduledSeq("warm-up-prefill", (0,) * chunk, 0, (0,) * -(-chunk // block_size), True)
        batches.append([prefill, _decode("warm-up-decode", 1, block_size)])
    shortest = 1 if graph_width is None else graph_width * block_size + 1   # eager decodes start here
    if shortest <= max_model_len:
        contexts = {shortest, max_model_len} | {1 << k for k in range(max_model_len.bit_length())
                                                if shortest <= 1 << k <= max_model_len}
        batches += [[_decode(f"warm-up-{c}", c, block_size)] for c in sorted(contexts)]
        full = min(max_num_seqs, max_num_batched_tokens)
        batches.append([_decode(f"warm-up-batch-{i}", shortest, block_size) for i in range(full)])
    return batches


@torch.inference_mode()
def warm_up(runner) -> float:
    """Run `warm_up_batches` through `runner` (a `ModelRunner`: its eager path, the tensor-parallel
    ranks included); returns the seconds it took."""
    start = time.perf_counter()
    buckets = runner.decode_buckets
    batches = warm_up_batches(runner.block_size, runner.max_num_batched_tokens, runner.max_num_seqs,
                              runner.max_model_len, None if buckets is None else buckets.width)
    for batch in batches:
        runner.run(batch)
    slot_of = runner.lora_slot_of
    if slot_of is not None and batches:   # no request runs yet: the map is the warm-up's alone
        slot_of.update((seq.request_id, 0) for seq in batches[0])
        try:
            runner.run(batches[0])
        finally:
            for seq in batches[0]:
                del slot_of[seq.request_id]
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - start
    log.info("warmed up %d eager step kinds in %.1f s", len(batches), seconds)
    return seconds
