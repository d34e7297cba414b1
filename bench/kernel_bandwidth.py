"""Time each Triton kernel against its torch reference and report achieved bandwidth.

    python bench/kernel_bandwidth.py            # CUDA: Llama-3-8B-like shapes, bf16
    python bench/kernel_bandwidth.py --small    # tiny shapes (also what runs on CPU)

GB/s counts the bytes a kernel must move: for attention the K/V it reads (plus q and out), for
the others their inputs and outputs. Attention cases with prefill chunks also print TFLOP/s (the
causal q.k and p.v work): there the prefill tiles are compute-bound and GB/s understates them.
``max_err`` is the max-abs difference from the reference (for attention, the fp32 reference,
which off the CPU is float64 math, so its "ref" timings are an oracle's, not a fast path's).

Variants: ``auto`` is what ``kernels.paged_attention`` runs. For batches with prefill chunks,
``64-row tiles (before)`` is the previous mixed-batch configuration (64-row query tiles on 4
warps, decode sequences inside those tiles) for a before/after on the same machine; decode-only
batches also time ``unified`` and ``split-K`` directly. ``silu_and_mul`` and
``rope_and_write_kv`` are the fused kernels; ``apply_rope + write_kv`` is the two-launch path
they replace. Without CUDA it says so, prints the reference timings on a small shape and exits 0.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.activation_ref import silu_and_mul_ref  # noqa: E402
from kernels.attention_ref import paged_attention_ref  # noqa: E402
from kernels.kv_write_ref import write_kv_ref  # noqa: E402
from kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref  # noqa: E402
from kernels.rope_kv_ref import rope_and_write_kv_ref  # noqa: E402
from kernels.rope_ref import apply_rope_ref  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timeit(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median seconds per call after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def paged_batch(specs, kv_heads, group, head_dim, block_size, dtype, device, num_layers=2):
    """Engine-layout KV (layer 0 used) filled with noise; specs are (context_len, query_len) pairs."""
    seq_lens = [c + q for c, q in specs]
    n_blocks = [math.ceil(s / block_size) for s in seq_lens]
    total = sum(n_blocks)
    kv = torch.randn((total + 1, num_layers, 2, block_size, kv_heads, head_dim), device=device).to(dtype)
    perm = (torch.randperm(total) + 1).to(torch.int32)  # scattered blocks, block 0 = null
    table = torch.zeros((len(specs), max(n_blocks)), dtype=torch.int32)
    used = 0
    for i, n in enumerate(n_blocks):
        table[i, :n] = perm[used: used + n]
        used += n
    num_tokens = sum(q for _, q in specs)
    q = torch.randn((num_tokens, kv_heads * group, head_dim), device=device).to(dtype)
    qsl = torch.tensor([0] + [q for _, q in specs]).cumsum(0).to(torch.int32)
    args = (q, kv[:, 0, 0], kv[:, 0, 1], table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
            qsl.to(device), 1.0 / math.sqrt(head_dim))
    kv_bytes = sum(seq_lens) * kv_heads * head_dim * 2 * kv.element_size() + 2 * q.numel() * q.element_size()
    return args, kv_bytes


def causal_flops(specs, num_heads: int, head_dim: int) -> int:
    """q.k and p.v FLOPs of causal attention: query i of a chunk after c cached tokens sees c + i + 1 keys."""
    pairs = sum(q * c + q * (q + 1) // 2 for c, q in specs)
    return 4 * pairs * num_heads * head_dim


def report(name: str, bytes_moved: int, fast: float | None, ref: float, err: float | None,
           flops: int | None = None) -> None:
    fast_s = f"{fast * 1e3:9.3f} ms {bytes_moved / fast / 1e9:8.1f} GB/s" if fast else " " * 25
    err_s = f"max_err {err:.2e}" if err is not None else ""
    flops_s = f"  {flops / fast / 1e12:6.1f} TFLOP/s" if flops and fast else ""
    print(f"{name:<44} triton {fast_s} | ref {ref * 1e3:9.3f} ms {bytes_moved / ref / 1e9:8.1f} GB/s  {err_s}"
          f"{flops_s}")


def attention_cases(small: bool, kv_heads: int, group: int, head_dim: int) -> dict[str, list[tuple[int, int]]]:
    if small:
        return {"decode 8 x 256": [(255, 1)] * 8, "mixed prefill+decode": [(64, 64)] * 2 + [(200, 1)] * 6}
    # The mixed case first: it is the one a time-boxed GPU run must not lose.
    return {
        "mixed 4x1024 chunks + 60 decodes": [(1024, 1024)] * 4 + [(2047, 1)] * 60,
        "decode 64 x 4096": [(4095, 1)] * 64,
        "decode 4 x 32768 (split-K)": [(32767, 1)] * 4,
        "prefill 4x1024 chunks": [(1024, 1024)] * 4,
    }


def bench_attention(args, device, dtype, run_triton: bool) -> None:
    if run_triton:
        from functools import partial

        from kernels.attention_splitk_triton import launch_split_k
        from kernels.attention_triton import launch_unified, paged_attention_triton
    for name, specs in attention_cases(args.small, args.kv_heads, args.group, args.head_dim).items():
        call, kv_bytes = paged_batch(specs, args.kv_heads, args.group, args.head_dim, args.block_size, dtype, device)
        ref_out = paged_attention_ref(*call, out_dtype=torch.float32)
        ref_t = timeit(lambda: paged_attention_ref(*call), device, max(2, args.iters // 4))
        decode_only = all(q == 1 for _, q in specs)
        flops = None if decode_only else causal_flops(specs, args.kv_heads * args.group, args.head_dim)
        if not run_triton:
            report(f"attention {name}", kv_bytes, None, ref_t, None, flops)
            continue
        variants = {"auto": paged_attention_triton}
        if decode_only:
            variants.update({"unified": launch_unified, "split-K": launch_split_k})
        else:
            variants["64-row tiles (before)"] = partial(launch_unified, block_m=64, split_decodes=False)
        for variant, fn in variants.items():
            err = (fn(*call).float() - ref_out).abs().max().item()
            report(f"attention {name} [{variant}]", kv_bytes, timeit(lambda: fn(*call), device, args.iters),
                   ref_t, err, flops)


def bench_elementwise(args, device, dtype, run_triton: bool) -> None:
    tokens, hidden = (64, 256) if args.small else (8192, 4096)
    heads, kv_heads, head_dim = args.kv_heads * args.group, args.kv_heads, args.head_dim
    esize = torch.finfo(dtype).bits // 8
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    res = torch.randn(tokens, hidden, device=device).to(dtype)
    w = torch.randn(hidden, device=device).to(dtype)
    q = torch.randn(tokens, heads, head_dim, device=device).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, device=device).to(dtype)
    pos = torch.randint(0, 8192, (tokens,), device=device)
    cache = torch.randn(8192, head_dim, device=device)
    block_size = args.block_size
    kv = torch.zeros((tokens // block_size + 2, 2, 2, block_size, kv_heads, head_dim), device=device, dtype=dtype)
    slots = torch.randperm(tokens, device=device) + block_size
    intermediate = 64 if args.small else 14336
    gate_up = torch.randn(tokens, 2 * intermediate, device=device).to(dtype)

    def rope_then_write(m):
        q_rot, k_rot = m.apply_rope(q, k, pos, cache)
        m.write_kv(k_rot, k, kv[:, 0, 0], kv[:, 0, 1], slots)
        return q_rot, k_rot

    rope_kv_bytes = (2 * q.numel() + 4 * k.numel()) * esize + 2 * k.numel() * esize  # q, k in+out; k, v to cache
    cases = {
        "rms_norm": (lambda m: m.rms_norm(x, w, 1e-5), lambda: rms_norm_ref(x, w, 1e-5), 2 * x.numel() * esize),
        "fused_add_rms_norm": (lambda m: m.fused_add_rms_norm(x, res, w, 1e-5),
                               lambda: fused_add_rms_norm_ref(x, res, w, 1e-5), 4 * x.numel() * esize),
        "apply_rope": (lambda m: m.apply_rope(q, k, pos, cache), lambda: apply_rope_ref(q, k, pos, cache),
                       2 * (q.numel() + k.numel()) * esize),
        "write_kv": (lambda m: m.write_kv(k, k, kv[:, 0, 0], kv[:, 0, 1], slots),
                     lambda: write_kv_ref(k, k, kv[:, 0, 0], kv[:, 0, 1], slots), 4 * k.numel() * esize),
        "rope_and_write_kv": (lambda m: m.rope_and_write_kv(q, k, k, pos, cache, kv[:, 0, 0], kv[:, 0, 1], slots),
                              lambda: rope_and_write_kv_ref(q, k, k, pos, cache, kv[:, 0, 0], kv[:, 0, 1], slots),
                              rope_kv_bytes),
        "apply_rope + write_kv": (rope_then_write,
                                  lambda: rope_and_write_kv_ref(q, k, k, pos, cache, kv[:, 0, 0], kv[:, 0, 1], slots),
                                  rope_kv_bytes),
        "silu_and_mul": (lambda m: m.silu_and_mul(gate_up), lambda: silu_and_mul_ref(gate_up),
                         3 * tokens * intermediate * esize),
    }
    import kernels

    for name, (fast, ref, nbytes) in cases.items():
        ref_t = timeit(ref, device, args.iters)
        if not run_triton:
            report(name, nbytes, None, ref_t, None)
            continue
        want, got = ref(), fast(kernels)
        err = None
        if want is not None:
            want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(want, got))
        report(name, nbytes, timeit(lambda: fast(kernels), device, args.iters), ref_t, err)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per kv head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="tiny shapes")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        print("CUDA is required for the Triton timings; reference-path timings on a small CPU shape:")
        args.small, args.dtype, args.kv_heads, args.group, args.head_dim = True, "fp32", 2, 4, 64
        args.iters = min(args.iters, 5)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype]
    print(f"device={device} dtype={args.dtype} kv_heads={args.kv_heads} group={args.group} "
          f"head_dim={args.head_dim} block_size={args.block_size}")
    with torch.inference_mode():
        if cuda:
            from kernels import backend

            backend.set_backend("triton")
        bench_attention(args, device, dtype, run_triton=cuda)
        bench_elementwise(args, device, dtype, run_triton=cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())
