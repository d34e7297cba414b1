"""Speculative decoding side by side: TPOT and throughput with and without drafts, per batch size and workload.

Workloads (`--workloads`), on `--model` (the `tiny` preset by default):
- `copy`: the prompt is `D + D[:8]` (`D`: 100 distinct tokens), decoded greedily. On the copying
  model (`--model copy`, `bench/copy_model.py`: a hand-built induction circuit in a Llama
  checkpoint) the output is the rest of `D`: the copying workload prompt lookup is for.
- `edit`: the text to rewrite is in the prompt. Each prompt is `D + C + D`: a random document
  `D`, the model's own greedy continuation `C` of it, and `D` again, decoded greedily: the output
  follows `C` in part (a random model also attends past the repeat), which is what prompt lookup
  is for, on a model that does not copy.
- `free`: random prompts sampled at temperature 1 (seeded): nothing in the prompt predicts the
  output, so drafts are nearly always rejected (what the adaptive off-switch is for).

Modes, run on the same prompts: `plain` (no speculation), `spec` (`--speculative-config` as a user
sets it: the adaptive controller decides per batch size and request) and `fixed` (the same drafts
on every step for every request, `FixedController`: what speculation costs or gives before the
controller steps in). The modes run *interleaved step by step* (`bench/interleaved.py`): each
mode's engine has the same batch of B requests, added at once, and the engines take turns, one
`Engine.step` each (the order running through every permutation of the modes), so a change in the
host's load lands on all modes alike. Each engine's clock is the sum of its own steps' times (all
the host work of a step included). TPOT is each request's (clock at its last token - at its
first) / (tokens - 1), averaged; throughput is output tokens / the engine's clock for the batch.
A warm-up batch per batch size runs first (the adaptive controller learns the batch size's costs
there, as a server does in its first seconds); then `--rounds` batches, and the table shows
medians over rounds.

`--waves W` (default 1) gives each round `W * B` requests at a concurrency of B (a finished
request's slot takes the next, as a server at that concurrency): throughput is then the steady
figure, tokens and seconds until the last request is admitted (`bench.interleaved`). A closed batch
(W = 1) ends in a drain, and speculation, which finishes some requests sooner than others, drains
through small, dear steps the plain batch never runs: its throughput there is the drain's more
than the decode's (`edit`, B = 8: TPOT 0.91x, closed-batch tok/s 0.94x in
session 9's runs; 0.86x and 0.98-1.01x in session 10's).

    .venv/bin/python bench/spec_decode.py --batch-sizes 1,8,32,128 --rounds 3
    .venv/bin/python bench/spec_decode.py --model copy --workloads copy,free --batch-sizes 1
    .venv/bin/python bench/spec_decode.py --workloads free --batch-sizes 1,8 \
        --speculative-config '{"method": "eagle", "model": "random", "num_speculative_tokens": 4}'

An EAGLE head named `random` is a random-weight head for `--model` (written next to it,
`tests/engine/hf_models.make_eagle_head`): it accepts almost nothing, so the figures are what the
head, its hidden-state ring and the adaptive controller cost where speculation cannot pay.

On a shared CPU, compare ratios measured in one run; absolute times drift with the load.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass

from bench.interleaved import run_interleaved

MODES = ("plain", "spec", "fixed")
WORKLOADS = ("edit", "free")   # the default; also `copy`
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
    from engine.sampling.params import SamplingParams

    if workload == "copy":
        from bench.copy_model import copy_prompts

        return copy_prompts(batch, seed, DOC_LEN)[0]
    docs = _documents(batch, seed)
    if workload == "free":
        return docs
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [d + out.output_token_ids + d for d, out in zip(docs, plain.generate(docs, greedy))]


def _params(workload: str, batch: int, max_tokens: int, seed: int):
    from engine.sampling.params import SamplingParams

    if workload in ("edit", "copy"):
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


def _run(engines: dict, prompts, params, concurrency: int | None = None) -> dict[str, Result]:
    """One batch per engine, stepped in turns (`bench.interleaved`), with each mode's drafts;
    `concurrency`: that many at a time (throughput: the steady figure)."""
    before = {m: engines[m].stats().spec_decode for m in engines}
    results = {}
    for mode, run in run_interleaved(engines, prompts, params, concurrency).items():
        after, drafts, accepted = engines[mode].stats().spec_decode, 0, 0
        if after is not None:
            drafts = after.num_draft_tokens - before[mode].num_draft_tokens
            accepted = after.num_accepted_tokens - before[mode].num_accepted_tokens
        results[mode] = Result(run.tpot, run.steady_throughput, drafts, accepted)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="a preset, a shape of bench/copy_model.py "
                        "(copy, copy-small) or a checkpoint directory")
    parser.add_argument("--batch-sizes", default="1,8,32,128")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help="plain first; fixed is optional")
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--waves", type=int, default=1, help="requests per round = waves x batch, batch at a time "
                        "(1: a closed batch)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from bench.copy_model import SHAPES, build

    model = str(build(args.model)) if args.model in SHAPES else args.model
    args.speculative_config = _random_eagle_head(args.speculative_config, model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    workloads = args.workloads.split(",")
    modes = args.modes.split(",")
    max_len = 2 * (DOC_LEN + 1) + 2 * args.max_tokens + 16
    print(f"model {args.model}; speculative config: {args.speculative_config}; {args.max_tokens} tokens per request, "
          f"{args.rounds} rounds, torch threads {args.threads}, "
          + ("closed batches" if args.waves == 1 else f"{args.waves} x batch requests a round at a concurrency of batch"))
    rows = []
    for workload in workloads:
        engines = {mode: _engine(model, mode, args.speculative_config, max(batches), max_len) for mode in modes}
        # `edit` prompts hold a greedy continuation: made by an engine of their own, since the one
        # that made them has their prefix cached (the plain engine's prefill would be ~half of it).
        maker = _engine(model, "plain", args.speculative_config, max(batches), max_len) if workload == "edit" else None
        for batch in batches:
            results: dict[str, list[Result]] = {mode: [] for mode in modes}
            n, concurrency = batch * args.waves, None if args.waves == 1 else batch
            prompts = {r: _prompts(workload, n, r, maker, args.max_tokens)
                       for r in (999, *range(args.rounds))}
            # warm-up: kernels, allocator, the controller's first costs
            _run(engines, prompts[999], _params(workload, n, args.max_tokens, 999), concurrency)
            for r in range(args.rounds):
                for mode, result in _run(engines, prompts[r], _params(workload, n, args.max_tokens, r),
                                         concurrency).items():
                    results[mode].append(result)
            rows.append((workload, batch, results))
            _print_row(workload, batch, results, header=len(rows) == 1)
    _print_summary(rows)


def _random_eagle_head(spec_json: str, model: str) -> str:
    """`"model": "random"` in an EAGLE config: a random-weight head for `model`, written once."""
    import json
    from pathlib import Path

    from engine.presets import resolve_model_dir
    from tests.engine.hf_models import make_eagle_head

    raw = json.loads(spec_json)
    if raw.get("method") != "eagle" or raw.get("model") != "random":
        return spec_json
    target = resolve_model_dir(model)
    head = target.parent / f"{target.name}-eagle-random"
    if not (head / "model.safetensors").exists():
        make_eagle_head(target, head, seed=0)
    return json.dumps({**raw, "model": str(head)})


def _median(results: list[Result], field: str) -> float:
    return statistics.median(getattr(r, field) for r in results)


def _round_median(results: dict[str, list[Result]], mode: str, field: str) -> float:
    """The median over rounds of the mode's / plain's ratio, each round side by side: what the
    3% target reads (a ratio of medians can take its two medians from rounds under different load)."""
    return statistics.median(getattr(r, field) / getattr(p, field) for r, p in zip(results[mode], results["plain"]))


def _print_row(workload: str, batch: int, results: dict[str, list[Result]], header: bool) -> None:
    """Medians over rounds; `x`: the mode's over plain's (a ratio of medians), and per round in
    brackets; `rx`: the median of the per-round ratios."""
    others = [m for m in results if m != "plain"]
    if header:
        cols = " ".join(f"{m:>8} {'x':>5} {'rounds':>16}" for m in others)
        print(f"{'workload':<10} {'batch':>5} | {'TPOT plain':>10} {cols} | {'tok/s plain':>11} "
              + " ".join(f"{m:>8} {'x':>5}" for m in others) + " | " + " ".join(f"{'accept ' + m:>12}" for m in others))
    tpot = {m: _median(results[m], "tpot") for m in results}
    tput = {m: _median(results[m], "throughput") for m in results}

    def acceptance(mode: str) -> str:
        drafts = sum(r.drafts for r in results[mode])
        return f"{sum(r.accepted for r in results[mode]) / drafts:.2f}" if drafts else "-"

    def per_round(mode: str, field: str = "tpot") -> str:
        return ",".join(f"{getattr(r, field) / getattr(p, field):.2f}" for r, p in zip(results[mode], results["plain"]))

    print(f"{workload:<10} {batch:>5} | {tpot['plain'] * 1e3:>8.2f}ms "
          + " ".join(f"{tpot[m] * 1e3:>6.2f}ms {tpot[m] / tpot['plain']:>5.3f} {per_round(m):>16}" for m in others)
          + f" | {tput['plain']:>11.1f} " + " ".join(f"{tput[m]:>8.1f} {tput[m] / tput['plain']:>5.3f}" for m in others)
          + " | " + " ".join(f"{acceptance(m):>12}" for m in others)
          + " | tok/s x rounds " + " ".join(per_round(m, "throughput") for m in others)
          + " | rx TPOT " + " ".join(f"{_round_median(results, m, 'tpot'):.3f}" for m in others)
          + " tok/s " + " ".join(f"{_round_median(results, m, 'throughput'):.3f}" for m in others), flush=True)


def _print_summary(rows) -> None:
    worst = max((_median(res["spec"], "tpot") / _median(res["plain"], "tpot"), w, b) for w, b, res in rows)
    print(f"worst TPOT ratio with speculation (adaptive): {worst[0]:.3f} ({worst[1]}, batch {worst[2]})")
    worst = max((_round_median(res, "spec", "tpot"), w, b) for w, b, res in rows)
    least = min((_round_median(res, "spec", "throughput"), w, b) for w, b, res in rows)
    print(f"median of per-round ratios: worst TPOT {worst[0]:.3f} ({worst[1]}, batch {worst[2]}), "
          f"worst tok/s {least[0]:.3f} ({least[1]}, batch {least[2]})")


if __name__ == "__main__":
    main()
