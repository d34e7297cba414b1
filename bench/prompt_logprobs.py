"""What prompt logprobs cost: nothing for requests that do not ask, and how much for those that do.

Runs one offline workload (`--requests` prompts of `--prompt-len` random tokens, `--max-tokens`
greedy output tokens each, chunked prefill under `--budget`) through `Engine.generate` in a fresh
process per run, for each source tree in `--trees` (e.g. the base commit's worktree and this one),
alternating trees run by run so that load on the machine hits them alike. Reports the min and
median CPU seconds of the measured pass per tree (after a warm-up pass in the same process; with
one torch thread, CPU time is the work done and moves far less with other load on a shared
machine than wall time, which is shown too), and the median over runs of each case's CPU time over
the first case's in the same round (paired: the two ran seconds apart, under the same load). With `--asking`, the last tree also runs the same workload with `prompt_logprobs` 0 and
5 (what asking costs).

    git worktree add /tmp/base <base commit>
    .venv/bin/python bench/prompt_logprobs.py --trees /tmp/base,. --model tiny --asking
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


def child(args: argparse.Namespace) -> None:
    """One run, in the tree on sys.path: prints {"seconds": ...} as JSON."""
    import random

    import torch

    from engine.config import SchedulerConfig
    from engine.engine import Engine, EngineConfig
    from engine.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.model, scheduler=SchedulerConfig(max_num_batched_tokens=args.budget,
                                                                           max_num_seqs=args.requests)))
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    # Fresh prompts per pass: no pass reuses another's prefix cache.
    warm_up, prompts = ([[rng.randrange(4, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
                        for _ in range(2))
    extra = {} if args.prompt_logprobs < 0 else {"prompt_logprobs": args.prompt_logprobs}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, **extra)
    engine.generate(warm_up, params)
    wall, cpu = time.perf_counter(), time.process_time()
    engine.generate(prompts, params)
    print(json.dumps({"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall}))


def run_once(tree: Path, args: argparse.Namespace, prompt_logprobs: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--requests", str(args.requests),
           "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens), "--budget", str(args.budget),
           "--threads", str(args.threads), "--prompt-logprobs", str(prompt_logprobs)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default=".", help="comma list of source trees (the first is the baseline)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5, help="runs per tree (fresh process each)")
    ap.add_argument("--asking", action="store_true", help="also run the last tree with prompt_logprobs 0 and 5")
    ap.add_argument("--prompt-logprobs", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return

    trees = [Path(t).resolve() for t in args.trees.split(",")]
    cases = [(tree, -1) for tree in trees]
    if args.asking:
        cases += [(trees[-1], 0), (trees[-1], 5)]
    times: dict[tuple[Path, int], list[dict[str, float]]] = {case: [] for case in cases}
    for run in range(args.runs):
        for case in cases:
            result = run_once(case[0], args, case[1])
            times[case].append(result)
            print(f"  run {run}: {case[0]} prompt_logprobs={case[1]}: cpu {result['cpu']:.3f} s, "
                  f"wall {result['wall']:.3f} s", file=sys.stderr)
    base = min(r["cpu"] for r in times[cases[0]])
    print(f"\nmodel={args.model} requests={args.requests} prompt_len={args.prompt_len} max_tokens={args.max_tokens} "
          f"budget={args.budget} threads={args.threads}, {args.runs} runs each (alternating)")
    print(f"{'tree':32s} {'prompt_logprobs':>15s} {'cpu min s':>10s} {'cpu median':>10s} {'wall min s':>10s} "
          f"{'cpu min / first':>15s} {'paired median':>13s}")
    first = [r["cpu"] for r in times[cases[0]]]
    for (tree, lp), results in times.items():
        cpu = [r["cpu"] for r in results]
        label = "none" if lp < 0 else str(lp)
        paired = statistics.median(c / f for c, f in zip(cpu, first))
        print(f"{str(tree)[-32:]:32s} {label:>15s} {min(cpu):10.3f} {statistics.median(cpu):10.3f} "
              f"{min(r['wall'] for r in results):10.3f} {min(cpu) / base:15.3f} {paired:13.3f}")


if __name__ == "__main__":
    main()
