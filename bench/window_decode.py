"""Long-context decode on CPU with and without sliding windows: what a window saves.

One model (default the `small` preset), three attention layouts over the same weights: every
layer full; Gemma 3's pattern (five local layers of `--window` keys to one global); every layer
windowed (Mistral's `sliding_window`). Each times `ModelRunner.run` on decode batches at
`--context` (the same runner and kernels the engine uses; the CPU path is the torch reference,
which gathers only the blocks a window reaches), and counts the KV blocks a sequence holds: all
of them unless every layer is windowed, when the engine frees the blocks behind the window
(their table entries are the null block here, as the scheduler leaves them). Prints one table;
min and median over `--iters` rounds, each round one step of each layout in turn (side by side in
one process, so load on the machine slows all three alike).

    .venv/bin/python bench/window_decode.py                       # small, context 4000, window 512
    .venv/bin/python bench/window_decode.py --decode 1 --context 2000 --window 256 --iters 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.step_time import decode_batch, time_step  # noqa: E402
from engine.block_pool import NULL_BLOCK_ID  # noqa: E402
from engine.kv_cache import allocate_kv_cache  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.presets import resolve_model_dir  # noqa: E402
from engine.scheduling.scheduler import ScheduledSeq  # noqa: E402


def layouts(num_layers: int, window: int) -> dict[str, tuple[int, ...]]:
    """name -> per-layer windows (0: full attention). The mixed layout makes every sixth layer
    global, and the last one when there are fewer than six."""
    mixed = tuple(0 if (i + 1) % 6 == 0 or i + 1 == num_layers < 6 else window for i in range(num_layers))
    return {
        "full": (),
        "gemma3 5:1": mixed,
        "all windowed": (window,) * num_layers,
    }


def freed(batch: list[ScheduledSeq], window: int, block_size: int) -> list[ScheduledSeq]:
    """The batch as the scheduler leaves it when every layer is windowed: the blocks wholly
    behind each query's window are the null block in its table."""
    out = []
    for seq in batch:
        behind = max(0, seq.start_position - window + 1) // block_size
        out.append(seq._replace(block_ids=(NULL_BLOCK_ID,) * behind + seq.block_ids[behind:]))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="preset name or checkpoint directory")
    ap.add_argument("--decode", default="1,4", help="comma list of decode batch sizes")
    ap.add_argument("--context", type=int, default=4000, help="context length of each decode sequence")
    ap.add_argument("--window", type=int, default=512, help="the local layers' sliding window")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    batches = [int(b) for b in args.decode.split(",") if b.strip()]
    cpu, bs = torch.device("cpu"), args.block_size
    blocks_per_seq = -(-args.context // bs)
    kv = allocate_kv_cache(cfg, max(batches) * blocks_per_seq + 1, bs, torch.float32, cpu)
    runners = {}
    for name, windows in layouts(cfg.num_layers, args.window).items():
        layout_cfg = dataclasses.replace(cfg, layer_windows=windows)
        model = load_model(model_dir, layout_cfg, torch.float32, cpu, args.context + 1)
        runners[name] = (layout_cfg, ModelRunner(model, kv, bs, cpu, max_num_seqs=max(batches),
                                                 max_model_len=args.context + 1))
    rows = []
    for b in batches:
        batch = decode_batch(b, args.context, bs, cfg.vocab_size)
        cases = {name: freed(batch, args.window, bs) if layout_cfg.kv_free_window else batch
                 for name, (layout_cfg, _) in runners.items()}
        # Round robin, one run per layout at a time: a loaded machine slows all three alike.
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.iters):
            for name, (_, runner) in runners.items():
                times[name].append(time_step(runner, cases[name], 1)[0])
        for name in runners:
            held = sum(1 for block in cases[name][0].block_ids if block != NULL_BLOCK_ID)
            rows.append((name, b, held, min(times[name]), statistics.median(times[name])))
            print(f"  {name:13s} decode {b}x{args.context}: {min(times[name]):8.1f} ms, {held} blocks/seq",
                  file=sys.stderr)

    full = {b: best for name, b, _, best, _ in rows if name == "full"}
    print(f"\nmodel={args.model} ({model_dir.name}, {cfg.num_layers} layers), window={args.window}, "
          f"block_size={bs}, threads={args.threads}, torch {torch.__version__}; ms per decode step "
          f"(min / median of {args.iters})")
    print(f"{'layout':14s} {'case':>14s} {'KV blocks/seq':>14s} {'min ms':>8s} {'median ms':>10s} {'vs full':>8s}")
    for name, b, held, best, median in rows:
        print(f"{name:14s} {f'{b}x{args.context}':>14s} {held:14d} {best:8.1f} {median:10.1f} "
              f"{best / full[b]:7.2f}x")


if __name__ == "__main__":
    main()
