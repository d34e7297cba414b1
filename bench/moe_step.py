"""A mixture of experts beside the dense model of equal active parameters: decode step time, and
the fused MoE kernel's bandwidth on a GPU.

Step time (any device; CPU by default): two random models on the `small` preset's shape (hidden
1024, 16 heads over 8 KV heads) with `--layers` layers: an MoE whose layers route each token to
`--top-k` of `--experts` experts of width `--expert-size`, and a dense model whose MLP is
`top_k * expert_size` wide, so a token meets the same number of weights in both (the router's
`experts x hidden` aside). The same `ModelRunner` the engine uses times whole decode steps
(`bench/step_time.py`'s batches), the two models alternating round by round so that machine load
hits both alike; the table gives min and median ms and the MoE / dense ratio of the medians.
`--clock cpu` times the thread's CPU time instead of the wall clock (CPU, one torch thread: the
step runs inline in this thread), which a loaded shared machine disturbs far less.

    .venv/bin/python bench/moe_step.py                          # CPU: 8 experts top-2, batch 1 and 32
    .venv/bin/python bench/moe_step.py --clock cpu              # the same, CPU time of the thread
    .venv/bin/python bench/moe_step.py --experts 64 --top-k 8 --expert-size 352
    .venv/bin/python bench/moe_step.py --device cuda --dtype bfloat16 --kernel   # GPU: + kernel bandwidth

Kernel bandwidth (`--kernel`, CUDA only): `kernels.fused_moe` alone on real layer shapes
(Qwen3-30B-A3B: 128 experts top-8, hidden 2048, width 768; Mixtral-8x7B: 8 top-2, 4096, 14336)
at decode batches, GB/s over the bytes it must move (the weights of every expert that got a
token, plus activations in and out), beside the device's copy bandwidth (`copy_` of 1 GiB).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.step_time import decode_batch  # noqa: E402
from engine.kv_cache import allocate_kv_cache  # noqa: E402
from engine.loader import build_model  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.presets import resolve_model_dir  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KERNEL_SHAPES = {   # name: (experts, top_k, hidden, expert width)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


def shapes(args) -> dict[str, ModelConfig]:
    """The dense and the MoE config, equal in active parameters."""
    base = dataclasses.replace(ModelConfig.from_dir(resolve_model_dir("small")), num_layers=args.layers)
    dense = dataclasses.replace(base, intermediate_size=args.top_k * args.expert_size)
    moe = dataclasses.replace(base, architecture="mixtral", num_experts=args.experts, num_experts_per_tok=args.top_k,
                              moe_intermediate_size=args.expert_size, norm_topk_prob=True)
    return {"dense": dense, "moe": moe}


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_len: int, seed: int):
    model = build_model(cfg, dtype, device, max_len)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:     # matrices and expert stacks, O(1/sqrt(fan_in)): routers spread tokens
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) / p.shape[-1] ** 0.5)
    return model


def active_params(cfg: ModelConfig) -> int:
    """Parameters a decode token multiplies by: attention, MLP (top-k experts + router), head."""
    h = cfg.hidden_size
    attn = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    mlp = 3 * h * (cfg.num_experts_per_tok * cfg.moe_intermediate_size if cfg.num_experts else cfg.intermediate_size)
    router = h * cfg.num_experts
    return cfg.num_layers * (attn + mlp + router) + cfg.vocab_size * h


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_steps(args, device: torch.device, dtype: torch.dtype) -> None:
    cfgs = shapes(args)
    batches = [int(b) for b in args.batch.split(",")]
    blocks = max(batches) * -(-args.context // args.block_size) + 1
    runners = {}
    for i, (name, cfg) in enumerate(cfgs.items()):
        model = random_model(cfg, dtype, device, args.context + 1, seed=i)
        kv = allocate_kv_cache(cfg, blocks, args.block_size, dtype, device)
        runners[name] = ModelRunner(model, kv, args.block_size, device, max_num_seqs=max(batches),
                                    max_num_batched_tokens=max(batches), max_model_len=args.context + 1)
        runners[name].capture_cuda_graphs()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print(f"device={device.type} dtype={args.dtype} threads={args.threads} clock={args.clock} layers={args.layers} "
          f"experts={args.experts} top_k={args.top_k} expert_size={args.expert_size} context={args.context}; "
          f"active params: dense {active_params(cfgs['dense']) / 1e6:.1f}M, moe {active_params(cfgs['moe']) / 1e6:.1f}M")
    print(f"{'batch':>5s}  {'model':6s} {'min ms':>8s} {'median ms':>10s}  {'moe/dense':>9s}")
    for batch in batches:
        scheduled = decode_batch(batch, args.context, args.block_size, cfgs["dense"].vocab_size)
        times: dict[str, list[float]] = {name: [] for name in runners}
        for runner in runners.values():
            runner.run(scheduled)                          # warm-up
        for _ in range(args.iters):                       # alternate, so load hits both
            for name, runner in runners.items():
                _sync(device)
                t0 = clock()
                runner.run(scheduled)
                _sync(device)
                times[name].append((clock() - t0) * 1e3)
        med = {name: statistics.median(t) for name, t in times.items()}
        for name, t in times.items():
            ratio = f"{med['moe'] / med['dense']:9.2f}" if name == "moe" else ""
            print(f"{batch:5d}  {name:6s} {min(t):8.2f} {med[name]:10.2f}  {ratio}")


def _cuda_ms(fn, iters: int) -> float:
    fn(), fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bench_kernel(args, dtype: torch.dtype) -> None:
    import kernels

    device = torch.device("cuda")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / (_cuda_ms(lambda: dst.copy_(src), 20) / 1e3) / 1e9
    del src, dst
    print(f"\nfused MoE kernel, {args.dtype}; copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'shape':15s} {'batch':>5s} {'experts hit':>11s} {'us':>8s} {'GB/s':>7s} {'% copy':>7s}")
    for name, (experts, top_k, hidden, width) in KERNEL_SHAPES.items():
        gen = torch.Generator(device=device).manual_seed(0)
        w13 = torch.randn((experts, 2 * width, hidden), device=device, dtype=dtype, generator=gen) / hidden ** 0.5
        w2 = torch.randn((experts, hidden, width), device=device, dtype=dtype, generator=gen) / width ** 0.5
        for batch in [int(b) for b in args.kernel_batch.split(",")]:
            x = torch.randn((batch, hidden), device=device, dtype=dtype, generator=gen)
            logits = torch.randn((batch, experts), device=device, generator=gen)
            weights, ids = torch.topk(logits.softmax(-1), top_k)
            hit = int(torch.unique(ids).numel())
            moved = hit * 3 * hidden * width * dtype.itemsize + 2 * batch * hidden * dtype.itemsize
            ms = _cuda_ms(lambda: kernels.fused_moe(x, w13, w2, weights, ids), args.iters * 10)
            gbs = moved / (ms / 1e3) / 1e9
            print(f"{name:15s} {batch:5d} {hit:11d} {ms * 1e3:8.1f} {gbs:7.0f} {100 * gbs / copy_gbs:6.0f}%")
        del w13, w2


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                    help="cpu: this thread's CPU time (CPU device, --threads 1 only)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-size", type=int, default=1408, help="each expert's intermediate size")
    ap.add_argument("--batch", default="1,32", help="comma list of decode batch sizes")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--kernel", action="store_true", help="also time the fused MoE kernel alone (CUDA)")
    ap.add_argument("--kernel-batch", default="1,8,64,256")
    ap.add_argument("--no-steps", action="store_true", help="only the kernel (with --kernel)")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.clock == "cpu" and (device.type != "cpu" or args.threads != 1):
        ap.error("--clock cpu needs --device cpu --threads 1 (other threads' work would not count)")
    if not args.no_steps:
        bench_steps(args, device, dtype)
    if args.kernel:
        if device.type != "cuda":
            print("--kernel needs --device cuda: skipped", file=sys.stderr)
        else:
            bench_kernel(args, dtype)


if __name__ == "__main__":
    main()
