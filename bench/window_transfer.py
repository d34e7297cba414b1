"""What a P/D handoff moves for a model whose every layer has a sliding window (Mistral).

    python bench/window_transfer.py                          # 4k and 16k prompts, 1k window
    python bench/window_transfer.py --prompts 4096 --shape tiny --skip-gloo

For each prompt the KV of a prefilled (held) request is pulled, as a decode pod pulls it, two ways:
  all      every prompt block (what cbserve sent before the window-aware pull)
  window   only the blocks from `floor((prompt - window + 1) / block_size)` on: those the decode
           pod's first query reads, all it reserves (`KVCacheManager.first_block_in_window`)
over gRPC (PullKV on 127.0.0.1 through KVSource/KVSink, checksums on, arms alternating round by
round) and over a Gloo pair between two processes (the bytes of the same runs). It prints the
bytes and blocks each arm moves and the median seconds, and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # keep grpc's INFO lines out of the table

import grpc  # noqa: E402

from bench.kv_transfer import SHAPES, bench_gloo, make_cache  # noqa: E402
from wire import cbserve_pb2, cbserve_pb2_grpc  # noqa: E402
from engine.block_pool import BlockPool  # noqa: E402
from engine.kv_cache_manager import KVCacheManager  # noqa: E402
from kvtransfer.grpc_options import channel_options  # noqa: E402
from kvtransfer.grpc_transport import KVSink, pull_kv  # noqa: E402
from kvtransfer.layout import KVLayout  # noqa: E402
from kvtransfer.packing import resolve_max_chunk_bytes  # noqa: E402
from kvtransfer.testing import PullKVServicer, start_server  # noqa: E402


def first_block_in_window(num_tokens: int, window: int, block_size: int) -> int:
    """Where the pods start a pull: the engine's own rule."""
    return KVCacheManager(BlockPool(2, False), block_size, window).first_block_in_window(num_tokens)


async def bench_grpc(src: torch.Tensor, dst: torch.Tensor, num_tokens: int, starts: dict[str, int],
                     repeats: int) -> dict[str, tuple[float, int]]:
    """Arm -> (median seconds of a pull of a held request, bytes it moved)."""
    layout = KVLayout.from_tensor(src)
    layout_info = layout.to_model_info("bench", "bench")
    servicer = PullKVServicer(src, layout_info)
    server, port = await start_server(servicer)
    ids = list(range(1, layout.num_blocks_for(num_tokens) + 1))
    times: dict[str, list[float]] = {arm: [] for arm in starts}
    moved: dict[str, int] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
            stub = cbserve_pb2_grpc.PrefillServiceStub(channel)
            for i in range(repeats + 1):   # round 0 warms up the channel and the pages
                for arm, start in (starts.items() if i % 2 else reversed(starts.items())):
                    rid = f"{arm}{i}"
                    servicer.add_request(rid, num_tokens, start_block_index=start).finish(1, ids)
                    request = cbserve_pb2.PullKVRequest(request_id=rid, model=layout_info, transport="grpc")
                    began = time.perf_counter()
                    result = await pull_kv(stub, request, KVSink(dst, ids, rid, num_tokens, start_block_index=start))
                    if i:
                        times[arm].append(time.perf_counter() - began)
                    moved[arm] = result.num_bytes
    finally:
        await server.stop(0)
    return {arm: (statistics.median(times[arm]), moved[arm]) for arm in starts}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="4096,16384", help="comma list of prompt lengths")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--shape", default="llama8b", choices=sorted(SHAPES),
                        help="KV block shape (llama8b: Mistral-7B's too, 32 layers x 8 KV heads x 128, bf16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-gloo", action="store_true")
    args = parser.parse_args(argv)
    layout = SHAPES[args.shape]
    max_chunk_bytes = resolve_max_chunk_bytes(0, layout)
    print(f"KV handoff of a held prompt, shape {args.shape} ({layout.bytes_per_block / 2**10:.0f} KiB per "
          f"{layout.block_size}-token block), window {args.window}, median of {args.repeats}")
    print(f"{'prompt':>7} {'arm':<7} {'blocks':>7} {'MiB':>8} {'grpc s':>8} {'gloo s':>8}")
    for prompt in (int(p) for p in args.prompts.split(",")):
        num_blocks = layout.num_blocks_for(prompt)
        starts = {"all": 0, "window": first_block_in_window(prompt, args.window, layout.block_size)}
        src = make_cache(layout, num_blocks + 1)
        dst = torch.zeros_like(src)
        grpc_rows = asyncio.run(bench_grpc(src, dst, prompt, starts, args.repeats))
        del src, dst
        rows = {}
        for arm, start in starts.items():
            seconds, num_bytes = grpc_rows[arm]
            assert num_bytes == (num_blocks - start) * layout.bytes_per_block
            gloo = None if args.skip_gloo else bench_gloo(args.shape, num_blocks - start, max_chunk_bytes, args.repeats)
            rows[arm] = (num_blocks - start, num_bytes, seconds, gloo)
            print(f"{prompt:>7} {arm:<7} {num_blocks - start:>7} {num_bytes / 2**20:>8.1f} {seconds:>8.3f} "
                  f"{'-' if gloo is None else f'{gloo:.3f}':>8}")
        (b_all, _, g_all, l_all), (b_win, _, g_win, l_win) = rows["all"], rows["window"]
        gloo_ratio = f", gloo time {l_all / l_win:.1f}x" if l_all is not None else ""
        print(f"{prompt:>7} all/window: bytes {b_all / b_win:.1f}x, grpc time {g_all / g_win:.1f}x{gloo_ratio}")


if __name__ == "__main__":
    main()
