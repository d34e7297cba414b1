"""Decode step time of the whole engine on a real model's shape, beside its memory-bandwidth bound.

For each batch size B, B requests with random prompts are prefilled so that the first timed step
attends over `--context` tokens, then `engine.step()` is timed while every scheduled sequence
decodes one token (a check counts steps that were not pure B-wide decodes). Two timings:

* per step: `synchronize; t0; engine.step(); synchronize; t1`, median and p10/p90 over `--steps`;
* window: `--steps` more steps back to back between two synchronizes, their mean (what a
  pipelined engine gets when it overlaps one step's CPU work with the previous step's GPU work).

The bound is the bytes a decode step must read, over the device's copy bandwidth measured here
with a large device-to-device copy (bytes read + written, as METHOD.md counts them):
weights (every parameter except the embedding table, whose B rows are negligible) plus the K/V of
every sequence at its mean context over the timed steps. `ratio` = median / bound (1.0 is ideal).

`--quantization fp8` / `--kv-cache-dtype fp8` run the same steps with e4m3 weights and KV; the
bound then counts 1 byte per projection weight and per K/V element, and `weight_memory_bytes`
reports what the loaded model's parameters take (embedding and lm_head stay in the model dtype).

    python bench/decode_step.py --shape 1b --device cuda --batch 1,8,64,256 --context 256
    python bench/decode_step.py --shape 8b --device cuda --batch 1,64 --quantization fp8 --kv-cache-dtype fp8
    python bench/decode_step.py --shape tiny --device cpu --batch 1,2 --context 32 --json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):   # `python bench/decode_step.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shapes import SHAPES, engine_config_fields, model_dir  # noqa: E402
from engine.config import KV_CACHE_DTYPES, QUANTIZATIONS, CacheConfig, SchedulerConfig  # noqa: E402
from engine.engine import Engine, EngineConfig  # noqa: E402
from engine.kv_cache import bytes_per_block  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 10) -> float:
    """Bytes/s of `dst.copy_(src)`, counting bytes read plus written; median of `iters`."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 2):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None = None) -> int:
    """Weight bytes a decode step reads: every layer, the final norm and the head; an untied
    embedding table only for its B rows (left out). From the config, not the module: the CPU path
    repacks its parameters. fp8 (int8): projections at 1 byte plus an fp32 scale per output channel."""
    h = cfg.hidden_size
    elem = torch.empty((), dtype=dtype).element_size()
    proj_out = (cfg.q_size + 2 * cfg.kv_size) + h + 2 * cfg.intermediate_size + h    # qkv, o, gate_up, down
    proj = (cfg.q_size + 2 * cfg.kv_size) * h + cfg.q_size * h + 3 * cfg.intermediate_size * h
    proj_bytes = proj + 4 * proj_out if quantization else proj * elem
    return cfg.num_layers * (proj_bytes + 2 * h * elem) + (h + cfg.vocab_size * h) * elem


def weight_memory_bytes(model: torch.nn.Module) -> int:
    """What the loaded model's weights take in memory, the embedding included: its parameters and
    the buffers that replaced some (oneDNN-packed weights on CPU), not the RoPE table."""
    tensors = list(model.parameters()) + [b for name, b in model.named_buffers() if not name.endswith("rope_cache")]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def kv_bytes(cfg: ModelConfig, dtype: torch.dtype, batch: int, context: float) -> int:
    """K and V of `batch` sequences of `context` tokens, every layer."""
    per_token = bytes_per_block(cfg, 1, dtype)
    return int(batch * context * per_token)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def fill_decode_batch(engine: Engine, batch: int, prompt_len: int, max_tokens: int, seed: int) -> list[str]:
    """Adds `batch` random prompts and steps until each has its first token (prefill done)."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(3, vocab) for _ in range(prompt_len)], params).request_id
           for _ in range(batch)]
    waiting = set(ids)
    while waiting:
        for out in engine.step():
            waiting.discard(out.request_id)
    return ids


def is_pure_decode(engine: Engine, batch: int) -> bool | None:
    """Whether the last step decoded one token for each of `batch` sequences (None: unknown)."""
    out = getattr(engine, "last_schedule", None)
    scheduled = getattr(out, "scheduled", None)
    if scheduled is None:
        return None
    return len(scheduled) == batch and all(len(s.token_ids) == 1 for s in scheduled)


def time_batch(engine: Engine, batch: int, args, device: torch.device, copy_bw: float, w_bytes: int) -> dict:
    cfg = engine.model_config
    prompt_len = args.context - args.warmup - 1       # the first timed step attends over `context`
    # Long enough that no sequence finishes inside the window, early-prefilled ones included.
    max_tokens = engine.max_model_len - prompt_len
    ids = fill_decode_batch(engine, batch, prompt_len, max_tokens, args.seed + batch)
    not_decode = 0
    for _ in range(args.warmup):
        engine.step()
    per_step = []
    for _ in range(args.steps):
        synchronize(device)
        t0 = time.perf_counter()
        engine.step()
        synchronize(device)
        per_step.append((time.perf_counter() - t0) * 1e3)
        not_decode += is_pure_decode(engine, batch) is False
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
        not_decode += is_pure_decode(engine, batch) is False
    synchronize(device)
    window_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    for rid in ids:
        engine.abort(rid)
    # Sequences that finished prefill early decoded a few extra tokens; the mean context of the
    # per-step phase is `context + (steps - 1) / 2` for the last one prefilled.
    mean_context = args.context + (args.steps - 1) / 2
    kv = kv_bytes(cfg, engine.kv_cache.dtype, batch, mean_context)
    bound_ms = (w_bytes + kv) / copy_bw * 1e3
    median = statistics.median(per_step)
    return {
        "batch": batch, "context": args.context, "median_ms": round(median, 4),
        "p10_ms": round(percentile(per_step, 0.1), 4), "p90_ms": round(percentile(per_step, 0.9), 4),
        "window_mean_ms": round(window_ms, 4), "kv_bytes": kv, "bound_ms": round(bound_ms, 4),
        "ratio": round(median / bound_ms, 2), "output_tok_s": round(batch / median * 1e3, 1),
        "steps_not_pure_decode": not_decode,
    }


def build_engine(args, path: Path, batches: list[int]) -> tuple[Engine, list[str]]:
    cfg = ModelConfig.from_dir(path)
    dtype_name = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    budget = max(args.max_num_batched_tokens, max(batches))
    fill_steps = -(-max(batches) * args.context // budget)   # early-prefilled sequences decode meanwhile
    max_len = args.context + 2 * args.steps + fill_steps + 8
    block_size = 16
    blocks = max(batches) * (-(-max_len // block_size) + 1) + 16
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else DTYPES[dtype_name]
    kv_option = {"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype != "auto" else {}
    cache = CacheConfig(block_size=block_size, kv_cache_memory_bytes=blocks * bytes_per_block(cfg, block_size, kv_dtype),
                        enable_prefix_caching=False, **kv_option)
    scheduler = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max(batches))
    # No text is read here: the detokenizer would only add host time to every step (as in the pods).
    options = {"detokenize": False, **({"enforce_eager": True} if args.enforce_eager else {})}
    if args.quantization:
        options["quantization"] = args.quantization
    fields, missing = engine_config_fields(EngineConfig, **options)
    config = EngineConfig(model=str(path), device=args.device, dtype=dtype_name, max_model_len=max_len,
                          cache=cache, scheduler=scheduler, **fields)
    return Engine(config), missing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", *SHAPES], default="1b")
    ap.add_argument("--batch", default="1,8,64,256", help="comma list of decode batch sizes")
    ap.add_argument("--context", type=int, default=256, help="tokens each sequence attends over at the first timed step")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--steps", type=int, default=50, help="timed steps per phase (per-step, then window)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="prefill budget while filling")
    ap.add_argument("--enforce-eager", action="store_true", help="EngineConfig.enforce_eager (if this engine has it)")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help="fp8: e4m3 linears (GPU: _scaled_mm)")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="fp8: e4m3 KV cache")
    ap.add_argument("--copy-gb", type=float, default=None, help="copy size for the bandwidth (default 2 GB CUDA, 0.1 CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.context < args.warmup + 3 or args.steps < 1:
        ap.error("--context must exceed --warmup + 2 and --steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    t0 = time.perf_counter()
    path = model_dir(args.shape, args.device)
    build_s = time.perf_counter() - t0
    engine, missing = build_engine(args, path, batches)
    load_s = time.perf_counter() - t0 - build_s
    copy_gb = args.copy_gb if args.copy_gb is not None else (2.0 if device.type == "cuda" else 0.1)
    copy_bw = copy_bandwidth(device, int(copy_gb * 1e9))
    w_bytes = weight_bytes(engine.model_config, engine.dtype, getattr(engine, "quantization", args.quantization))
    w_memory = weight_memory_bytes(engine.model)
    rows = []
    for batch in batches:
        row = time_batch(engine, batch, args, device, copy_bw, w_bytes)
        rows.append(row)
        print(f"# batch {batch}: median {row['median_ms']:.3f} ms, bound {row['bound_ms']:.3f} ms", file=sys.stderr)
    result = {
        "shape": args.shape, "model_dir": str(path), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(engine.dtype).removeprefix("torch."), "torch": torch.__version__,
        "enforce_eager": args.enforce_eager, "unsupported_options": missing,
        "quantization": args.quantization, "kv_cache_dtype": str(engine.kv_cache.dtype).removeprefix("torch."),
        "copy_bandwidth_gb_s": round(copy_bw / 1e9, 1), "weight_bytes": w_bytes, "weight_memory_bytes": w_memory,
        "kv_cache_blocks": engine.cache_config.num_blocks, "checkpoint_s": round(build_s, 1),
        "engine_load_s": round(load_s, 1), "steps": args.steps, "warmup": args.warmup, "rows": rows,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.shape} on {result['device_name']} ({result['dtype']}, quantization {args.quantization or 'none'}, "
          f"KV {result['kv_cache_dtype']}), weights read {w_bytes / 1e9:.2f} GB, in memory {w_memory / 2**30:.2f} GiB, "
          f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print(f"{'batch':>5} {'ctx':>5} {'median ms':>10} {'p10':>8} {'p90':>8} {'window ms':>10} {'bound ms':>9} "
          f"{'ratio':>6} {'tok/s':>9}")
    for r in rows:
        print(f"{r['batch']:5d} {r['context']:5d} {r['median_ms']:10.3f} {r['p10_ms']:8.3f} {r['p90_ms']:8.3f} "
              f"{r['window_mean_ms']:10.3f} {r['bound_ms']:9.3f} {r['ratio']:6.2f} {r['output_tok_s']:9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
