"""The engine's host step alone: schedule, prepare, sample, resolve, update and emit, with no model.

The engine (`tiny` preset, async scheduling as on CUDA, decode graphs' padded bucket path, no
detokenizer as in the pods and the GPU benches) runs a steady decode batch of `--batch` requests
whose model is instant: its forward returns a prepared hidden state and its head prepared logits
(the decode buckets' shared logits buffer, filled once). What is left per step is the host work a
GPU step has to hide: the figure to hold below the GPU's step time (about 1 ms for a 1B model at
batch 1, 1.5-2 ms at batch 256 on an H200). Reported per batch size: the median and p90 wall
time of one `Engine.step()` (and its p10: on a shared machine the closest to the step's own
cost), and its thread CPU time. `--churn N` measures a batch whose membership changes: a request
ends and a new one arrives (its prefill chunk in the same step) every N steps. Its steps are of
N kinds (the arrival's mixed step, the step after it, the steady ones), so their median sits on
whichever kind straddles the middle: read the mean too (printed after the table), the host time
a token costs.

`--tree NAME=PATH` measures another checkout side by side (PYTHONPATH=PATH; each measurement is
a subprocess running this file from this checkout against that tree's engine), alternating,
`--rounds` times; the table shows medians over rounds.

    git worktree add /tmp/host-base <commit>
    .venv/bin/python bench/host_step.py --tree base=/tmp/host-base --tree new=. --rounds 3

On a shared CPU the absolute figures mean little: compare trees measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class InstantModel:
    """The model's interface at no cost (what the runner calls): forward returns a prepared
    hidden state, the head prepared logits, or the buffer it was told to write (already holding
    logits: the decode buckets' shared buffer, filled once)."""

    def __init__(self, model, rows: int) -> None:
        import torch

        self.cfg = model.cfg
        dtype = next(model.parameters()).dtype
        self.hidden = torch.zeros(rows, model.cfg.hidden_size, dtype=dtype)
        self.logits = torch.randn(rows, model.cfg.vocab_size, generator=torch.Generator().manual_seed(0)).to(dtype)

    def __call__(self, input_ids, positions, kv_cache, meta):
        return self.hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden, out=None):
        return self.logits[: hidden.shape[0]] if out is None else out

    def parameters(self):
        return iter([self.hidden])


def measure(args, batch: int) -> dict:
    """One tree, one batch size (runs in the tree's subprocess)."""
    import torch

    from engine.config import CacheConfig, SchedulerConfig
    from engine.engine import Engine, EngineConfig
    from engine.model_runner import ModelRunner
    from engine.sampling.params import SamplingParams

    torch.set_num_threads(1)
    prompt_len, block, churn = 32, 16, args.churn
    max_tokens = args.warmup + args.steps + 16
    # --churn N: request i ends after its (i+1)-th N steps of the timed run, and a new one arrives
    # every N steps (its prefill chunk rides in that step), so about `batch` requests run.
    first_end = args.warmup + 8
    num_blocks = batch * -(-(prompt_len + max_tokens + churn * batch) // block) + 64
    max_tokens_per_step = max(2048, batch)
    max_num_seqs = batch + (8 if churn else 0)
    engine = Engine(EngineConfig(model=args.model, async_scheduling=True, detokenize=args.detokenize,
                                 cache=CacheConfig(block_size=block, num_blocks=num_blocks),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=max_tokens_per_step,
                                                           max_num_seqs=max_num_seqs)))
    # The GPU's runner: decode steps padded to a bucket, as the CUDA graphs run them (not captured here).
    runner = ModelRunner(engine.model, engine.kv_cache, block, engine.device, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_tokens_per_step, max_model_len=engine.max_model_len,
                         enforce_eager=False)
    instant = InstantModel(engine.model, max_tokens_per_step)
    runner.model = instant
    runner.decode_buckets.logits.copy_(instant.logits[: runner.decode_buckets.logits.shape[0]])
    engine.runner = runner
    def add(i: int, num_tokens: int) -> None:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=num_tokens,
                                ignore_eos=True, seed=0 if args.temperature else None)
        engine.add_request([1] + [(7 * i + j) % 200 + 3 for j in range(prompt_len - 1)], params)

    for i in range(batch):
        add(i, first_end + (i + 1) * churn if churn else max_tokens)
    while engine.scheduler.num_waiting or any(len(s.token_ids) > 1 for s in engine.last_schedule.scheduled
                                              if engine.last_schedule) or engine.num_steps < 2:
        engine.step()                       # prefill until every request decodes
    for _ in range(args.warmup):
        engine.step()
    wall, cpu = [], []
    for step in range(args.steps):
        if churn and step % churn == 0:
            add(batch + step, batch * churn)
        w0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    if not churn:
        assert engine.scheduler.num_running == batch and all(len(s.token_ids) == 1
                                                             for s in engine.last_schedule.scheduled)
    wall.sort()
    return {"batch": batch, "median_us": 1e6 * statistics.median(wall), "mean_us": 1e6 * statistics.fmean(wall),
            "p10_us": 1e6 * wall[len(wall) // 10],
            "p90_us": 1e6 * wall[int(0.9 * len(wall))], "cpu_us": 1e6 * statistics.median(cpu), "steps": args.steps}


def run_tree(path: Path, args, batch: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(path), "CBSERVE_CACHE_DIR": os.environ.get("CBSERVE_CACHE_DIR",
                                                                                     str(ROOT / ".cache"))}
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", str(batch), *sys.argv[1:]]
    out = subprocess.run(argv, cwd=path, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{path}: batch {batch} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: dict[str, dict[int, list[dict]]], batches: list[int]) -> str:
    names = list(results)
    lines = ["| batch | " + " | ".join(f"{n}: median, p10 / p90 µs (CPU µs)" for n in names) +
             (" | " + f"{names[-1]} / {names[0]}" if len(names) > 1 else "") + " |",
             "|---" * (len(names) + 1 + (len(names) > 1)) + "|"]
    for b in batches:
        meds = {n: statistics.median(r["median_us"] for r in results[n][b]) for n in names}
        cells = [f"{meds[n]:.0f}, {statistics.median(r['p10_us'] for r in results[n][b]):.0f} / "
                 f"{statistics.median(r['p90_us'] for r in results[n][b]):.0f} "
                 f"({statistics.median(r['cpu_us'] for r in results[n][b]):.0f})" for n in names]
        ratio = [f"x{meds[names[-1]] / meds[names[0]]:.2f}"] if len(names) > 1 else []
        lines.append(f"| {b} | " + " | ".join(cells + ratio) + " |")
    return "\n".join(lines)


def mean_table(results: dict[str, dict[int, list[dict]]], batches: list[int]) -> str:
    """Mean µs per step (medians over rounds), trees side by side."""
    names = list(results)
    lines = ["| batch | " + " | ".join(f"{n}: mean µs" for n in names) +
             (f" | {names[-1]} / {names[0]}" if len(names) > 1 else "") + " |", "|---" * (len(names) + 1 + (len(names) > 1)) + "|"]
    for b in batches:
        means = [statistics.median(r["mean_us"] for r in results[n][b]) for n in names]
        ratio = [f"x{means[-1] / means[0]:.2f}"] if len(names) > 1 else []
        lines.append(f"| {b} | " + " | ".join([f"{m:.0f}" for m in means] + ratio) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="a checkout to measure (default: this one); the first is the ratio's base")
    p.add_argument("--batch", default="1,64,256", help="comma list of decode batch sizes")
    p.add_argument("--steps", type=int, default=300, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--model", default="tiny")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded random sampling")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--detokenize", action="store_true", help="run the detokenizer too (offline use)")
    p.add_argument("--churn", type=int, default=0, metavar="N",
                   help="a request ends and one arrives every N timed steps (0: the same batch throughout)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)   # the subprocess side
    args = p.parse_args()
    if args.worker is not None:
        sys.path.insert(0, os.getcwd())        # the tree's engine, not this checkout's
        print(json.dumps(measure(args, args.worker)))
        return
    batches = [int(b) for b in args.batch.split(",")]
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(ROOT)}
    results: dict[str, dict[int, list[dict]]] = {n: {b: [] for b in batches} for n in trees}
    for r in range(args.rounds):
        for b in batches:
            for name, path in trees.items():
                result = run_tree(Path(path).resolve(), args, b)
                results[name][b].append(result)
                print(json.dumps({"round": r, "tree": name, **result}), flush=True)
    print(table(results, batches))
    print(mean_table(results, batches))


if __name__ == "__main__":
    main()
