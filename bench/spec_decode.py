"""Speculative decoding side by side: TPOT and throughput with and without drafts, per batch size and workload.

Workloads (`--workloads`), both on the `tiny` preset:
- `edit`: the text to rewrite is in the prompt. Each prompt is `D + C + D`: a random document
  `D`, the model's own greedy continuation `C` of it, and `D` again, decoded greedily: the output
  follows `C` in part (a random model also attends past the repeat), which is what prompt lookup
  is for. (A model trained to copy would be a truer edit workload; training one did not converge
  on this CPU in the time there was: see docs/benchmarks.md.)
- `free`: random prompts sampled at temperature 1 (seeded): nothing in the prompt predicts the
  output, so drafts are nearly always rejected (what the adaptive off-switch is for).

Modes, run on the same prompts, alternating within each round: `plain` (no speculation), `spec`
(`--speculative-config` as a user sets it: the adaptive controller decides per batch size and
request) and `fixed` (the same drafts on every step for every request, `FixedController`: what
speculation costs or gives before the controller steps in). Each batch of B requests starts at
once; TPOT is each request's (last token - first token) / (tokens - 1), averaged; throughput is
output tokens / the batch's wall time. A warm-up batch per mode and batch size runs first (the
adaptive controller learns the batch size's rates there, as a server does in its first seconds).

    .venv/bin/python bench/spec_decode.py --batch-sizes 1,8,32,128 --rounds 3

On a shared CPU, compare ratios measured in one run; absolute times drift with the load.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

MODES = ("plain", "spec", "fixed")
WORKLOADS = ("edit", "free")
DOC_LEN = 100


@dataclass
class Result:
    tpot: float            # mean seconds per output token after the first
    throughput: float      # output tokens / second
    drafts: int = 0
    accepted: int = 0


def _documents(batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, 260) for _ in range(DOC_LEN)] for _ in range(batch)]


def _prompts(workload: str, batch: int, seed: int, plain, max_tokens: int) -> list[list[int]]:
    """`free`: the documents; `edit`: document + the plain engine's greedy continuation + document."""
    from engine.sampling_params import SamplingParams

    docs = _documents(batch, seed)
    if workload == "free":
        return docs
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [d + out.output_token_ids + d for d, out in zip(docs, plain.generate(docs, greedy))]


def _params(workload: str, batch: int, max_tokens: int, seed: int):
    from engine.sampling_params import SamplingParams

    if workload == "edit":
        return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * batch
    return [SamplingParams(temperature=1.0, seed=seed * 1000 + i, max_tokens=max_tokens, ignore_eos=True)
            for i in range(batch)]


def _engine(model: str, mode: str, spec_json: str, max_seqs: int, max_len: int):
    from engine.config import CacheConfig, SchedulerConfig
    from engine.engine import Engine, EngineConfig
    from engine.spec_decode.adaptive import FixedController
    from engine.spec_decode.config import SpeculativeConfig

    spec = None if mode == "plain" else SpeculativeConfig.from_json(spec_json)
    num_blocks = max_seqs * -(-max_len // 16) + 64
    engine = Engine(EngineConfig(model=model, speculative=spec, detokenize=False,
                                 cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=max(2048, 4 * max_seqs),
                                                           max_num_seqs=max_seqs)))
    if mode == "fixed":
        engine.spec.controller = FixedController(spec.num_speculative_tokens)
    return engine


def _run(engine, prompts, params) -> Result:
    """One batch: every request added at once, stepped to the end."""
    before = engine.stats().spec_decode
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params)]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = dict.fromkeys(ids, 0)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            count[out.request_id] += len(out.new_token_ids)
    wall = time.perf_counter() - start
    tpots = [(last[i] - first[i]) / (count[i] - 1) for i in ids if count[i] > 1]
    after = engine.stats().spec_decode
    drafts = accepted = 0
    if after is not None:
        drafts = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return Result(statistics.mean(tpots), sum(count.values()) / wall, drafts, accepted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8,32,128")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    workloads = args.workloads.split(",")
    max_len = 2 * (DOC_LEN + 1) + 2 * args.max_tokens + 16
    print(f"speculative config: {args.speculative_config}; {args.max_tokens} tokens per request, "
          f"{args.rounds} rounds, torch threads {args.threads}")
    rows = []
    for workload in workloads:
        engines = {mode: _engine("tiny", mode, args.speculative_config, max(batches), max_len) for mode in MODES}
        for batch in batches:
            results: dict[str, list[Result]] = {mode: [] for mode in MODES}
            prompts = {r: _prompts(workload, batch, r, engines["plain"], args.max_tokens)
                       for r in (999, *range(args.rounds))}
            for mode in MODES:     # warm-up: kernels, allocator, the controller's first rates
                _run(engines[mode], prompts[999], _params(workload, batch, args.max_tokens, 999))
            for r in range(args.rounds):
                order = MODES if r % 2 == 0 else MODES[::-1]
                for mode in order:
                    results[mode].append(_run(engines[mode], prompts[r], _params(workload, batch, args.max_tokens, r)))
            rows.append((workload, batch, results))
            _print_row(workload, batch, results, header=len(rows) == 1)
    _print_summary(rows)


def _median(results: list[Result], field: str) -> float:
    return statistics.median(getattr(r, field) for r in results)


def _print_row(workload: str, batch: int, results: dict[str, list[Result]], header: bool) -> None:
    if header:
        print(f"{'workload':<10} {'batch':>5} | {'TPOT plain':>10} {'spec':>8} {'x':>5} {'fixed':>8} {'x':>5} | "
              f"{'tok/s plain':>11} {'spec':>8} {'x':>5} {'fixed':>8} {'x':>5} | {'accept spec':>11} {'fixed':>6}")
    tpot = {m: _median(results[m], "tpot") for m in MODES}
    tput = {m: _median(results[m], "throughput") for m in MODES}

    def acceptance(mode: str) -> str:
        drafts = sum(r.drafts for r in results[mode])
        return f"{sum(r.accepted for r in results[mode]) / drafts:.2f}" if drafts else "-"

    print(f"{workload:<10} {batch:>5} | {tpot['plain'] * 1e3:>8.2f}ms {tpot['spec'] * 1e3:>6.2f}ms "
          f"{tpot['spec'] / tpot['plain']:>5.2f} {tpot['fixed'] * 1e3:>6.2f}ms {tpot['fixed'] / tpot['plain']:>5.2f} | "
          f"{tput['plain']:>11.1f} {tput['spec']:>8.1f} {tput['spec'] / tput['plain']:>5.2f} {tput['fixed']:>8.1f} "
          f"{tput['fixed'] / tput['plain']:>5.2f} | {acceptance('spec'):>11} {acceptance('fixed'):>6}", flush=True)


def _print_summary(rows) -> None:
    worst = max((_median(res["spec"], "tpot") / _median(res["plain"], "tpot"), w, b) for w, b, res in rows)
    print(f"worst TPOT ratio with speculation (adaptive): {worst[0]:.3f} ({worst[1]}, batch {worst[2]})")


if __name__ == "__main__":
    main()
