"""How fast KV moves between pods, and how much of it streaming hides behind the prefill.

    python bench/kv_transfer.py                      # tiny + Llama-3-8B-shaped caches, CPU
    python bench/kv_transfer.py --shapes tiny --json
    python bench/kv_transfer.py --prefill-chunk-ms 80 --chunk-tokens 512

For each cache shape it moves the KV of one `--prompt-tokens` prompt (synthetic tensors) by:
  copy    torch copy of the same blocks into destination blocks, one process (the ceiling)
  grpc    PullKV on 127.0.0.1 through KVSource/KVSink (server and client in this process,
          one event loop; checksums on)
  gloo    raw runs over a Gloo PairGroup between two processes (bytes only, no gRPC)
and reports median seconds and GB/s. `streamed` replays a chunked prefill: `--chunk-tokens` of
KV become available every `--prefill-chunk-ms`, PullKV is open from the start, and it reports
the transfer time left after the last chunk ("exposed") divided by the time of the same
transfer after the prefill ("grpc"): 0 means streaming hid the transfer completely.
"""

from __future__ import annotations

import argparse
import asyncio
import binascii
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # keep grpc's INFO lines out of the table

import grpc  # noqa: E402

from wire import cbserve_pb2, cbserve_pb2_grpc  # noqa: E402
from kvtransfer.collective import PairGroup, connect_store, host_store  # noqa: E402
from kvtransfer.grpc_options import channel_options  # noqa: E402
from kvtransfer.grpc_transport import KVSink, pull_kv  # noqa: E402
from kvtransfer.layout import KVLayout  # noqa: E402
from kvtransfer.packing import plan_runs, resolve_max_chunk_bytes, run_tensor, scatter_blocks  # noqa: E402
from kvtransfer.testing import PullKVServicer, start_server  # noqa: E402

SHAPES = {
    "tiny": KVLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32),
    "llama8b": KVLayout(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16),
}


def make_cache(layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """[num_blocks, *block_shape] of random bytes (bytes are all a transfer sees)."""
    kv = torch.empty((num_blocks, *layout.block_shape), dtype=layout.dtype)
    kv.reshape(-1).view(torch.int16 if layout.dtype.itemsize == 2 else torch.int32).random_()
    return kv


def bench_checksums(num_bytes: int = 4 << 20, repeats: int = 5) -> dict[str, float]:
    """GB/s of the stdlib checksums over one default-sized message (`packing` uses zlib.crc32)."""
    data = memoryview(torch.randint(0, 256, (num_bytes,), dtype=torch.uint8).numpy())
    speeds = {}
    for name, fn in (("zlib.crc32", zlib.crc32), ("binascii.crc32", binascii.crc32),
                     ("zlib.adler32 (not a crc)", zlib.adler32)):
        fn(data)
        start = time.perf_counter()
        for _ in range(repeats):
            fn(data)
        speeds[name] = num_bytes * repeats / (time.perf_counter() - start) / 1e9
    return speeds


def bench_copy(src: torch.Tensor, dst: torch.Tensor, ids: list[int], repeats: int) -> float:
    times = []
    scatter_blocks(dst, ids, src[ids[0]: ids[-1] + 1])  # warm-up: first-touch page faults
    for _ in range(repeats):
        start = time.perf_counter()
        scatter_blocks(dst, ids, src[ids[0]: ids[-1] + 1])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def bench_grpc(src: torch.Tensor, dst: torch.Tensor, ids: list[int], num_tokens: int,
                     repeats: int, max_chunk_bytes: int, chunk_tokens: int,
                     chunk_seconds: float) -> tuple[float, float]:
    """(median seconds of a pull after prefill, median seconds exposed after a streamed prefill)."""
    layout = KVLayout.from_tensor(src)
    model = layout.to_model_info("bench", "bench")
    servicer = PullKVServicer(src, model)
    server, port = await start_server(servicer)
    after, exposed = [], []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
            stub = cbserve_pb2_grpc.PrefillServiceStub(channel)

            def request(request_id: str) -> cbserve_pb2.PullKVRequest:
                return cbserve_pb2.PullKVRequest(request_id=request_id, model=model, transport="grpc",
                                                 max_chunk_bytes=max_chunk_bytes)

            for i in range(repeats + 1):  # the first round warms up the channel
                servicer.add_request(f"after{i}", num_tokens).finish(1, ids)
                start = time.perf_counter()
                await pull_kv(stub, request(f"after{i}"), KVSink(dst, ids, f"after{i}", num_tokens))
                if i:
                    after.append(time.perf_counter() - start)

                progress = servicer.add_request(f"stream{i}", num_tokens)
                pull = asyncio.create_task(
                    pull_kv(stub, request(f"stream{i}"), KVSink(dst, ids, f"stream{i}", num_tokens)))
                for computed in range(chunk_tokens, num_tokens, chunk_tokens):
                    await asyncio.sleep(chunk_seconds)  # the forward pass of one prefill chunk
                    progress.advance(computed, ids)
                await asyncio.sleep(chunk_seconds)
                progress.finish(1, ids)
                prefill_done = time.perf_counter()
                await pull
                if i:
                    exposed.append(time.perf_counter() - prefill_done)
    finally:
        await server.stop(0)
    return statistics.median(after), statistics.median(exposed)


def bench_gloo(shape: str, num_blocks: int, max_chunk_bytes: int, repeats: int) -> float:
    """Median seconds to receive (and scatter) all runs, sent by a child process."""
    layout = SHAPES[shape]
    store = host_store("127.0.0.1", 0)
    child = subprocess.Popen([sys.executable, __file__, "--gloo-sender", str(store.port),
                              "--shapes", shape, "--num-blocks", str(num_blocks),
                              "--max-chunk-bytes", str(max_chunk_bytes), "--repeats", str(repeats)])
    dst = torch.empty((num_blocks + 1, *layout.block_shape), dtype=layout.dtype)
    ids = list(range(1, num_blocks + 1))
    runs = plan_runs(ids, 0, num_blocks, max_chunk_bytes // layout.bytes_per_block)

    async def receive() -> list[float]:
        group = await PairGroup.create(store, "bench", rank=1, backend="gloo", timeout_s=60)
        times = []
        for i in range(repeats + 1):  # round 0 warms up (and waits for the sender to start)
            start = time.perf_counter()
            for run in runs:
                payload = await group.recv_run(f"r{i}", run.first_block_index,
                                               run.num_blocks * layout.bytes_per_block)
                scatter_blocks(dst, ids[run.first_block_index: run.first_block_index + run.num_blocks], payload)
            times.append(time.perf_counter() - start)
        return times[1:]

    try:
        times = asyncio.run(receive())
    finally:
        child.wait(timeout=60)
    return statistics.median(times)


def gloo_sender(store_port: int, shape: str, num_blocks: int, max_chunk_bytes: int, repeats: int) -> None:
    layout = SHAPES[shape]
    src = make_cache(layout, num_blocks + 1)
    ids = list(range(1, num_blocks + 1))
    runs = plan_runs(ids, 0, num_blocks, max_chunk_bytes // layout.bytes_per_block)

    async def send() -> None:
        group = await PairGroup.create(connect_store("127.0.0.1", store_port), "bench", rank=0,
                                       backend="gloo", timeout_s=60)
        for i in range(repeats + 1):
            for run in runs:
                await group.send_run(f"r{i}", run.first_block_index, run_tensor(src, run))
        group.close()

    asyncio.run(send())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,llama8b", help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--chunk-tokens", type=int, default=512, help="prefill chunk size")
    parser.add_argument("--prefill-chunk-ms", type=float, default=50.0,
                        help="measured time of one prefill chunk's forward pass")
    parser.add_argument("--max-chunk-bytes", type=int, default=0, help="0 = default (4 MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-gloo", action="store_true")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--gloo-sender", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--num-blocks", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gloo_sender is not None:
        gloo_sender(args.gloo_sender, args.shapes, args.num_blocks, args.max_chunk_bytes, args.repeats)
        return

    rows = []
    for shape in args.shapes.split(","):
        layout = SHAPES[shape]
        num_blocks = layout.num_blocks_for(args.prompt_tokens)
        max_chunk_bytes = resolve_max_chunk_bytes(args.max_chunk_bytes, layout)
        num_bytes = num_blocks * layout.bytes_per_block
        src = make_cache(layout, num_blocks + 1)
        dst = torch.zeros_like(src)
        ids = list(range(1, num_blocks + 1))
        row = {"shape": shape, "dtype": layout.dtype_name, "prompt_tokens": args.prompt_tokens,
               "mib": num_bytes / 2**20, "max_chunk_bytes": max_chunk_bytes,
               "copy_s": bench_copy(src, dst, ids, args.repeats)}
        row["grpc_s"], row["exposed_s"] = asyncio.run(bench_grpc(
            src, dst, ids, args.prompt_tokens, args.repeats, max_chunk_bytes, args.chunk_tokens,
            args.prefill_chunk_ms / 1000))
        if not args.skip_gloo:
            row["gloo_s"] = bench_gloo(shape, num_blocks, max_chunk_bytes, args.repeats)
        for name in ("copy", "grpc", "gloo"):
            if f"{name}_s" in row:
                row[f"{name}_gbps"] = num_bytes / row[f"{name}_s"] / 1e9
        row["exposed_ratio"] = row["exposed_s"] / row["grpc_s"]
        rows.append(row)

    checksums = bench_checksums()
    if args.json:
        print(json.dumps({"prefill_chunk_ms": args.prefill_chunk_ms, "chunk_tokens": args.chunk_tokens,
                          "checksum_gbps": checksums, "rows": rows}, indent=2))
        return
    print(f"KV of a {args.prompt_tokens}-token prompt; streamed prefill: {args.chunk_tokens} tokens "
          f"every {args.prefill_chunk_ms:g} ms")
    header = f"{'shape':<8} {'dtype':<8} {'MiB':>7} {'copy GB/s':>10} {'grpc s':>8} {'grpc GB/s':>10} " \
             f"{'gloo s':>8} {'gloo GB/s':>10} {'exposed s':>10} {'exposed/grpc':>13}"
    print(header)
    for r in rows:
        gloo = (f"{r['gloo_s']:>8.3f} {r['gloo_gbps']:>10.2f}" if "gloo_s" in r else f"{'-':>8} {'-':>10}")
        print(f"{r['shape']:<8} {r['dtype']:<8} {r['mib']:>7.1f} {r['copy_gbps']:>10.2f} {r['grpc_s']:>8.3f} "
              f"{r['grpc_gbps']:>10.2f} {gloo} {r['exposed_s']:>10.3f} {r['exposed_ratio']:>13.2f}")

    print("checksum GB/s (4 MiB): " + ", ".join(f"{name} {gbps:.2f}" for name, gbps in checksums.items()))


if __name__ == "__main__":
    main()
