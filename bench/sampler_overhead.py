"""Sampler overhead without a model: milliseconds per `Sampler.sample()` call.

Random fp32 logits (scaled like a real model's, so top-p keeps a few hundred tokens) and requests
with a 300-token prompt and 50 output tokens, for four settings: all greedy; temperature only;
top-k 50 + top-p 0.9; and every knob (temperature, top-k, top-p, min-p, repetition / presence /
frequency penalties, a seed, logprobs=5). One torch thread unless `--threads`; prints the median of
`--iters` timed calls per (setting, batch).

    .venv/bin/python bench/sampler_overhead.py [--batch 1 8 32 128] [--vocab 32000] [--iters 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.request import Request
from engine.sampling.sampler import Sampler
from engine.sampling.params import SamplingParams

SETTINGS: dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top-k+top-p": dict(temperature=0.8, top_k=50, top_p=0.9),
    "all knobs": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.1,
                      presence_penalty=0.3, frequency_penalty=0.2, seed=1234, logprobs=5),
}


def make_requests(batch: int, vocab: int, knobs: dict, seed: int) -> list[Request]:
    """`batch` requests with `knobs`, each with a 300-token prompt and 50 generated tokens."""
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(batch):
        tokens = torch.randint(vocab, (350,), generator=gen).tolist()
        request = Request(f"r{i}", tokens[:300], SamplingParams(**knobs))
        for token in tokens[300:]:
            request.append_output_token(token)
        requests.append(request)
    return requests


def time_sample(sampler: Sampler, logits: torch.Tensor, requests: list[Request], iters: int) -> float:
    """Median milliseconds of `iters` calls (after one warm-up call)."""
    sampler.sample(logits, requests)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        sampler.sample(logits, requests)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sampler = Sampler(eos_token_ids=[2])
    gen = torch.Generator().manual_seed(args.seed)
    print(f"vocab {args.vocab}, {args.threads} torch thread(s), median of {args.iters} calls, ms per sample()")
    print(f"{'setting':<14}" + "".join(f"{f'batch {b}':>12}" for b in args.batch))
    for name, knobs in SETTINGS.items():
        cells = []
        for batch in args.batch:
            logits = torch.randn(batch, args.vocab, generator=gen) * 4.0   # [batch, vocab]
            requests = make_requests(batch, args.vocab, knobs, args.seed)
            cells.append(time_sample(sampler, logits, requests, args.iters))
        print(f"{name:<14}" + "".join(f"{ms:12.2f}" for ms in cells))


if __name__ == "__main__":
    main()
