"""Offline throughput: cbserve's engine vs transformers' static-batch `generate()`, same weights.

Heterogeneous workload (input 32-512, output 16-256 tokens, fixed seed). Both run in this process
with the same torch thread count, one after the other; the figure that matters is the ratio.

    python bench/throughput.py --model small --num-prompts 64
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling_params import SamplingParams


def workload(n: int, vocab: int, seed: int, min_in: int, max_in: int, min_out: int, max_out: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(min_in, max_in))] for _ in range(n)]
    outputs = [rng.randint(min_out, max_out) for _ in range(n)]
    return prompts, outputs


def run_cbserve(args, prompts, outputs) -> float:
    engine = Engine(EngineConfig(
        model=args.model,
        cache=CacheConfig(kv_cache_memory_bytes=args.kv_cache_mb << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs),
    ))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    engine.generate([prompts[0]], SamplingParams(max_tokens=2))  # warm-up
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert [len(r.output_token_ids) for r in results] == outputs
    return elapsed


def run_hf(args, prompts, outputs) -> float:
    from transformers import AutoModelForCausalLM

    from engine.presets import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(args.model), dtype=torch.float32).eval()
    t0 = time.perf_counter()
    for start in range(0, len(prompts), args.hf_batch_size):
        batch, outs = prompts[start:start + args.hf_batch_size], outputs[start:start + args.hf_batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(outs),
                           min_new_tokens=max(outs), do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-mb", type=int, default=2048)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from engine.model_config import ModelConfig
    from engine.presets import resolve_model_dir

    vocab = ModelConfig.from_dir(resolve_model_dir(args.model)).vocab_size
    prompts, outputs = workload(args.num_prompts, vocab, args.seed, *args.input_len, *args.output_len)
    n_in, n_out = sum(map(len, prompts)), sum(outputs)
    ours = run_cbserve(args, prompts, outputs)
    hf = None if args.skip_hf else run_hf(args, prompts, outputs)
    result = {
        "model": args.model, "num_prompts": args.num_prompts, "input_tokens": n_in, "output_tokens": n_out,
        "threads": args.threads, "cbserve_seconds": round(ours, 2),
        "cbserve_output_tok_s": round(n_out / ours, 1), "cbserve_total_tok_s": round((n_in + n_out) / ours, 1),
    }
    if hf is not None:
        result.update(hf_seconds=round(hf, 2), hf_output_tok_s=round(n_out / hf, 1),
                      hf_batch_size=args.hf_batch_size, speedup=round(hf / ours, 2))
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>24}: {v}")


if __name__ == "__main__":
    main()
