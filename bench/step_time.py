"""Model step time on CPU: ms per `ModelRunner.run` for decode batches and a prefill chunk.

Builds the model (default the `small` preset) once per dtype, with the same runner the engine
uses, and times whole steps (prepare + forward + lm_head of the sampled rows) on synthetic
batches: `decode Bx<ctx>` is B sequences with `ctx - 1` cached tokens each computing one more,
`prefill N` one sequence computing N prompt tokens from scratch. The KV cache holds zeros: the
timings do not depend on its values. Prints one table; min and median over `--iters` runs.
`--clock cpu` times the thread's CPU time instead of the wall clock (one torch thread: the step
runs inline in this thread), which a loaded shared machine disturbs far less.

    .venv/bin/python bench/step_time.py                        # fp32, bf16, int8; 1 and 2 threads
    .venv/bin/python bench/step_time.py --dtypes float32 --threads 1 --decode 8 --prefill 0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kv_cache import allocate_kv_cache  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.presets import resolve_model_dir  # noqa: E402
from engine.progress import progress  # noqa: E402
from engine.quant import quantize_model  # noqa: E402
from engine.scheduling.scheduler import ScheduledSeq  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Pseudo-dtypes: (model dtype, --quantization).
QUANTIZED = {"int8": (torch.float32, "int8")}


def decode_batch(batch: int, context: int, block_size: int, vocab: int) -> list[ScheduledSeq]:
    """`batch` sequences at position `context - 1`, each on its own run of blocks."""
    n_blocks = -(-context // block_size)
    return [ScheduledSeq(f"d{i}", ((7 * i + 3) % vocab,), context - 1,
                         tuple(range(1 + i * n_blocks, 1 + (i + 1) * n_blocks)), True)
            for i in range(batch)]


def prefill_batch(tokens: int, block_size: int, vocab: int) -> list[ScheduledSeq]:
    """One sequence computing its first `tokens` prompt tokens (and sampling after them)."""
    ids = tuple((5 * j + 11) % vocab for j in range(tokens))
    return [ScheduledSeq("p0", ids, 0, tuple(range(1, 1 + -(-tokens // block_size))), True)]


def time_step(runner: ModelRunner, scheduled: list[ScheduledSeq], iters: int,
              clock=time.perf_counter) -> tuple[float, float]:
    """(min, median) ms of `runner.run(scheduled)` after one warm-up run."""
    runner.run(scheduled)
    times = []
    for _ in range(iters):
        t0 = clock()
        runner.run(scheduled)
        times.append((clock() - t0) * 1e3)
    return min(times), statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="preset name or checkpoint directory")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8",
                    help=f"comma list of {tuple(DTYPES) + tuple(QUANTIZED)} (int8: fp32 model, W8A8 linears)")
    ap.add_argument("--threads", default="1,2", help="comma list of torch thread counts")
    ap.add_argument("--decode", default="1,8,32", help="comma list of decode batch sizes")
    ap.add_argument("--context", type=int, default=300, help="context length of each decode sequence")
    ap.add_argument("--prefill", default="512", help="comma list of prefill chunk sizes (0: none)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                    help="cpu: this thread's CPU time (with --threads 1 only)")
    args = ap.parse_args(argv)
    if args.clock == "cpu" and args.threads != "1":
        ap.error("--clock cpu needs --threads 1 (other threads' work would not count)")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    model_dir = resolve_model_dir(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    decodes = [int(b) for b in args.decode.split(",") if b.strip()]
    prefills = [int(n) for n in args.prefill.split(",") if int(n) > 0]
    threads = [int(t) for t in args.threads.split(",")]
    cases = [(f"decode {b}x{args.context}", decode_batch(b, args.context, args.block_size, cfg.vocab_size))
             for b in decodes]
    cases += [(f"prefill {n}", prefill_batch(n, args.block_size, cfg.vocab_size)) for n in prefills]
    blocks_needed = max([b * -(-args.context // args.block_size) for b in decodes]
                        + [-(-n // args.block_size) for n in prefills] + [1]) + 1
    max_len = max([args.context] + prefills) + 1

    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype, quantization = QUANTIZED.get(dtype_name) or (DTYPES[dtype_name], None)
        model = load_model(model_dir, cfg, dtype, torch.device("cpu"), max_len)
        if quantization:
            quantize_model(model, quantization, torch.device("cpu"))
        kv = allocate_kv_cache(cfg, blocks_needed, args.block_size, dtype, torch.device("cpu"))
        runner = ModelRunner(model, kv, args.block_size, torch.device("cpu"))
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for name, scheduled in progress(cases, desc=f"{dtype_name}, {n_threads} threads", unit="case"):
                best, median = time_step(runner, scheduled, args.iters, clock)
                rows.append((dtype_name, n_threads, name, best, median))
                print(f"  {dtype_name:9s} threads={n_threads} {name:16s} {best:9.1f} ms", file=sys.stderr)
        del runner, model, kv

    print(f"\nmodel={args.model} ({model_dir.name}), torch {torch.__version__}, {args.clock}-clock ms per step "
          f"(min / median of {args.iters})")
    print(f"{'dtype':10s} {'threads':>7s}  {'case':18s} {'min ms':>9s} {'median ms':>10s}")
    for dtype_name, n_threads, name, best, median in rows:
        print(f"{dtype_name:10s} {n_threads:7d}  {name:18s} {best:9.1f} {median:10.1f}")


if __name__ == "__main__":
    main()
