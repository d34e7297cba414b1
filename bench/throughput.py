"""Offline throughput: cbserve's engine vs transformers' static-batch `generate()`, same weights.

Heterogeneous workload (input 32-512, output 16-256 tokens, fixed seed). Both run in this process
with the same torch thread count, one after the other; the figure that matters is the ratio.
`--shape 1b|8b` builds a random-weight checkpoint of that real model's shape (bench/shapes.py);
on CUDA both sides run in the checkpoint's dtype (bf16) after a short warm-up each.

    python bench/throughput.py --model small --num-prompts 64
    python bench/throughput.py --shape 1b --device cuda --num-prompts 512 --max-num-seqs 256 \
        --max-num-batched-tokens 8192 --kv-cache-mb 8192 --hf-batch-size 128
    python bench/throughput.py --shape 8b --device cuda --quantization fp8 --kv-cache-dtype fp8 --skip-hf ...

`--quantization` / `--kv-cache-dtype` apply to cbserve only (transformers runs the checkpoint as is).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):   # `python bench/throughput.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import KV_CACHE_DTYPES, QUANTIZATIONS, CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.kv_cache import bytes_per_block
from engine.sampling.params import SamplingParams


def workload(n: int, vocab: int, seed: int, min_in: int, max_in: int, min_out: int, max_out: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(min_in, max_in))] for _ in range(n)]
    outputs = [rng.randint(min_out, max_out) for _ in range(n)]
    return prompts, outputs


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_cbserve(args, prompts, outputs) -> tuple[float, int]:
    """(seconds, KV cache bytes the engine got)."""
    kv = {"kv_cache_memory_bytes": args.kv_cache_mb << 20} if args.kv_cache_mb else {}   # 0: the engine's default
    engine = Engine(EngineConfig(
        model=str(args.model), device=args.device, dtype=args.dtype, quantization=args.quantization,
        detokenize=False,      # tokens are counted, text is never read (transformers' side decodes none)
        cache=CacheConfig(enable_prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype, **kv),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs),
    ))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    engine.generate([prompts[0]], SamplingParams(max_tokens=2))  # warm-up
    device = torch.device(args.device)
    synchronize(device)
    t0 = time.perf_counter()
    results = engine.generate(prompts, params, progress_desc="cbserve")
    synchronize(device)
    elapsed = time.perf_counter() - t0
    assert [len(r.output_token_ids) for r in results] == outputs
    cache = engine.cache_config
    return elapsed, cache.num_blocks * bytes_per_block(engine.model_config, cache.block_size, engine.kv_cache.dtype)


def run_hf(args, prompts, outputs) -> float:
    from transformers import AutoModelForCausalLM

    from engine.presets import resolve_model_dir

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else "auto")
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(args.model), dtype=dtype).to(device).eval()
    with torch.no_grad():  # warm-up: kernels and workspaces, as the engine gets
        model.generate(input_ids=torch.tensor([prompts[0][:8]], device=device), max_new_tokens=2,
                       do_sample=False, pad_token_id=0)
    synchronize(device)
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
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(outs),
                           min_new_tokens=max(outs), do_sample=False, pad_token_id=0)
    synchronize(device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="preset name or checkpoint directory")
    ap.add_argument("--shape", choices=["1b", "8b"], default=None,
                    help="a random-weight checkpoint of this shape (bench/shapes.py) instead of --model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                    help="default: float32 on CPU, the checkpoint's on CUDA")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-mb", type=int, default=2048, help="0: the engine's default size")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help="cbserve's --quantization")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="cbserve's --kv-cache-dtype")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--hf-num-prompts", type=int, default=None,
                    help="transformers runs only the first N prompts (default: all); tok/s stays comparable")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from engine.model_config import ModelConfig
    from engine.presets import resolve_model_dir

    if args.shape:
        from bench.shapes import model_dir

        args.model = model_dir(args.shape, args.device)
    vocab = ModelConfig.from_dir(resolve_model_dir(args.model)).vocab_size
    prompts, outputs = workload(args.num_prompts, vocab, args.seed, *args.input_len, *args.output_len)
    n_in, n_out = sum(map(len, prompts)), sum(outputs)
    ours, kv_bytes = run_cbserve(args, prompts, outputs)
    gc.collect()   # the engine's weights, cache and graphs go before transformers loads its copy
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    hf_prompts = prompts[:args.hf_num_prompts] if args.hf_num_prompts else prompts
    hf_outputs = outputs[:len(hf_prompts)]
    hf = None if args.skip_hf else run_hf(args, hf_prompts, hf_outputs)
    result = {
        "model": args.shape or str(args.model), "device": args.device, "num_prompts": args.num_prompts, "input_tokens": n_in, "output_tokens": n_out,
        "threads": args.threads, "kv_cache_mb": args.kv_cache_mb, "kv_cache_bytes": kv_bytes, "cbserve_seconds": round(ours, 2),
        "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
        "cbserve_output_tok_s": round(n_out / ours, 1), "cbserve_total_tok_s": round((n_in + n_out) / ours, 1),
    }
    if hf is not None:
        hf_tok_s = sum(hf_outputs) / hf
        result.update(hf_num_prompts=len(hf_prompts), hf_seconds=round(hf, 2), hf_output_tok_s=round(hf_tok_s, 1),
                      hf_batch_size=args.hf_batch_size, speedup=round(n_out / ours / hf_tok_s, 2))
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>24}: {v}")


if __name__ == "__main__":
    main()
