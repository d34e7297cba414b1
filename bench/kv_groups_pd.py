"""P/D with KV groups: what a long chat's turn costs the decode pod, and what its pull moves.

    python bench/kv_groups_pd.py                      # Gemma 3 27B and gpt-oss 20b shapes, 32k chat
    python bench/kv_groups_pd.py --time-kv-heads 2 --time-prompt 8192 --repeats 3

Part 1, exact counts (the engine's own schedulers and KV cache managers, no model: the KV
accounting does not depend on the weights). The last turn of a chat that reached `--context`
tokens: a prompt of `context - answer` tokens, prefilled on a prefill-role scheduler in
`--chunk`-token chunks, reserved, landed and decoded for `--answer` tokens on a decode-role one.
Two arms on the same KV memory:
  one group   every block holds every layer's KV (P/D before KV groups: a mixed model's pods held
              and moved every block of every layer)
  groups      a table per KV group (engine/kv_groups/): a pull moves group 0's pages of every
              block and each local group's from its window's start (kvtransfer/kv_groups.py), the
              decode pod reserves only those and frees behind the windows as it decodes
It prints the decode pod's KV at reserve and at its peak, the prefill pod's peak, and the bytes
one pull moves.

Part 2 (`--repeats` > 0), seconds: the pull of a held prompt over PullKV on 127.0.0.1 (KVSource ->
KVSink, checksums on), one group vs groups, arms alternating round by round, for a Gemma 3
27B-shaped model scaled to `--time-kv-heads` KV heads and a `--time-prompt`-token prompt (the
27B shape at 32k is 15.5 GiB a side: more than this machine's memory).
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
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc  # noqa: E402

from bench.kv_groups import SHAPES  # noqa: E402
from bench.kv_transfer import make_cache  # noqa: E402
from engine.block_pool import BlockPool  # noqa: E402
from engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from engine.kv_cache_manager import KVCacheManager  # noqa: E402
from engine.kv_groups.spec import KVGroups  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402
from engine.scheduling.scheduler import Scheduler  # noqa: E402
from kvtransfer.grpc_options import channel_options  # noqa: E402
from kvtransfer.grpc_transport import KVSink, pull_kv  # noqa: E402
from kvtransfer.layout import KVLayout  # noqa: E402
from kvtransfer.testing import PullKVServicer, start_server  # noqa: E402
from wire import cbserve_pb2, cbserve_pb2_grpc  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20


def groups_of(windows: tuple[int, ...], grouped: bool) -> KVGroups:
    return KVGroups.for_windows(windows, len(windows)) if grouped else KVGroups.single(len(windows))


def pull_starts(groups: KVGroups, block_size: int, num_tokens: int) -> tuple[int, ...]:
    """Where a pull starts each group: the pods' own rule (`KVCacheManager.pull_starts`)."""
    start, group_starts = KVCacheManager(BlockPool(2, False), block_size, group_windows=groups.windows[1:]) \
        .pull_starts(num_tokens)
    return (start, *group_starts)


def scheduler(role: str, groups: KVGroups, page_bytes: int, memory: int, block_size: int, chunk: int,
              max_len: int) -> Scheduler:
    cache = CacheConfig(block_size=block_size, num_blocks=memory // page_bytes,
                        kv_group_windows=groups.windows if groups.is_hybrid else ())
    return Scheduler(SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=4, max_model_len=max_len),
                     cache, role=role)


def used(s: Scheduler) -> int:
    pool = s.kv_manager.block_pool
    return pool.num_usable_blocks - pool.num_free_blocks


def last_turn(windows: tuple[int, ...], kv_heads: int, head_dim: int, prompt: int, answer: int,
              block_size: int, chunk: int, grouped: bool, memory: int) -> dict[str, int]:
    """Pages (x page bytes) the prefill pod and the decode pod hold for one P/D request."""
    groups = groups_of(windows, grouped)
    page_bytes = groups.slots * 2 * block_size * kv_heads * head_dim * 2   # bf16
    tokens = [(7 * j) % 50_000 + 3 for j in range(prompt)]
    params = SamplingParams(max_tokens=answer, min_tokens=answer, ignore_eos=True)
    # Prefill pod: chunked prefill to the first token; the blocks stay held for the pull.
    p = scheduler("prefill", groups, page_bytes, memory, block_size, chunk, prompt + answer)
    p.add_request(Request("turn", list(tokens), params))
    prefill_peak = 0
    while p.has_unfinished_requests():
        out = p.schedule()
        p.update(out, {seq.request_id: 11 for seq in out.scheduled if seq.sample})
        prefill_peak = max(prefill_peak, used(p))
    # Decode pod: reserve (what the pull fills), land, decode the answer.
    d = scheduler("decode", groups, page_bytes, memory, block_size, chunk, prompt + answer)
    d.add_remote_request(Request("turn", list(tokens), params))
    d.schedule()
    reserved = used(d)
    d.remote_kv_landed("turn", 11)
    decode_peak = reserved
    while d.has_unfinished_requests():
        out = d.schedule()
        d.update(out, {seq.request_id: 11 for seq in out.scheduled if seq.sample})
        decode_peak = max(decode_peak, used(d))
    num_blocks = -(-prompt // block_size)
    moved = sum(num_blocks - start for start in pull_starts(groups, block_size, prompt))
    assert moved == reserved, (moved, reserved)   # the decode pod reserves exactly what the pull writes
    return {"page": page_bytes, "reserve": reserved * page_bytes, "decode_peak": decode_peak * page_bytes,
            "prefill_peak": prefill_peak * page_bytes, "pull": moved * page_bytes}


async def time_pulls(windows: tuple[int, ...], kv_heads: int, head_dim: int, prompt: int, block_size: int,
                     repeats: int) -> dict[str, tuple[float, int]]:
    """Arm -> (median seconds of one pull of a held prompt, bytes moved), arms alternating."""
    num_blocks = -(-prompt // block_size)
    arms = {}
    for arm, grouped in (("one group", False), ("groups", True)):
        groups = groups_of(windows, grouped)
        layout = KVLayout(groups.slots, block_size, kv_heads, head_dim, torch.bfloat16)
        starts = pull_starts(groups, block_size, prompt)
        # Group g's table: pages g * num_blocks + 1 ... (consecutive: runs coalesce as in a fresh pool).
        tables = [list(range(1 + g * num_blocks, 1 + (g + 1) * num_blocks)) for g in range(groups.num_groups)]
        src = make_cache(layout, 1 + groups.num_groups * num_blocks)
        info = layout.to_model_info("bench", "bench", kv_group_windows=groups.windows if grouped else (),
                                    num_model_layers=len(windows))
        arms[arm] = (src, torch.zeros_like(src), info, starts, tables)
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    moved: dict[str, int] = {}
    servers = []
    try:
        stubs = {}
        for arm, (src, _, info, _, _) in arms.items():
            servicer = PullKVServicer(src, info)
            server, port = await start_server(servicer)
            servers.append(server)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
            stubs[arm] = (servicer, channel, cbserve_pb2_grpc.PrefillServiceStub(channel))
        for i in range(repeats + 1):   # round 0 warms up the channels and the pages
            for arm in (list(arms) if i % 2 else list(reversed(arms))):
                src, dst, info, starts, tables = arms[arm]
                servicer, _, stub = stubs[arm]
                rid = f"{arm}{i}"
                servicer.add_request(rid, prompt, group_start_block_indices=starts[1:]).finish(
                    1, tables[0], group_block_ids=tables[1:])
                sink = KVSink(dst, tables[0], rid, prompt, group_dst_block_ids=tables[1:],
                              group_start_block_indices=starts[1:])
                began = time.perf_counter()
                result = await pull_kv(stub, cbserve_pb2.PullKVRequest(request_id=rid, model=info), sink)
                if i:
                    times[arm].append(time.perf_counter() - began)
                moved[arm] = result.num_bytes
        for g, (start, table) in enumerate(zip(arms["groups"][3], arms["groups"][4])):   # the bytes landed
            ids = table[start:]
            landed, sent = (arms["groups"][k][ids].view(torch.int16) for k in (1, 0))   # random bytes: NaNs
            assert torch.equal(landed, sent), f"group {g}"
        for _, channel, _ in stubs.values():
            await channel.close()
    finally:
        for server in servers:
            await server.stop(0)
    return {arm: (statistics.median(times[arm]), moved[arm]) for arm in arms}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--context", type=int, default=32768, help="tokens the chat reaches with its last answer")
    ap.add_argument("--answer", type=int, default=512, help="answer tokens of the last turn")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--memory-gib", type=float, default=40.0, help="KV memory of each pod, both arms")
    ap.add_argument("--repeats", type=int, default=3, help="timed pulls per arm (0: counts only)")
    ap.add_argument("--time-kv-heads", type=int, default=2, help="Gemma 3 27B's 16 KV heads scaled to this")
    ap.add_argument("--time-prompt", type=int, default=8192)
    args = ap.parse_args(argv)
    memory, prompt = int(args.memory_gib * GiB), args.context - args.answer
    print(f"P/D, the last turn of a {args.context}-token chat ({prompt}-token prompt, {args.answer}-token answer), "
          f"bf16, block {args.block_size}, {args.chunk}-token chunks, {args.memory_gib:g} GiB of KV a pod")
    print(f"{'shape':<12} {'arm':<10} {'decode reserve MiB':>19} {'decode peak MiB':>16} {'prefill peak MiB':>17} "
          f"{'pull MiB':>9}")
    for name in args.shapes.split(","):
        windows, kv_heads, head_dim = SHAPES[name]
        rows = {arm: last_turn(windows, kv_heads, head_dim, prompt, args.answer, args.block_size, args.chunk,
                               grouped, memory) for arm, grouped in (("one group", False), ("groups", True))}
        for arm, r in rows.items():
            print(f"{name:<12} {arm:<10} {r['reserve'] / MiB:>19,.1f} {r['decode_peak'] / MiB:>16,.1f} "
                  f"{r['prefill_peak'] / MiB:>17,.1f} {r['pull'] / MiB:>9,.1f}")
        one, grp = rows["one group"], rows["groups"]
        print(f"{name:<12} one/groups: decode peak {one['decode_peak'] / grp['decode_peak']:.2f}x, prefill peak "
              f"{one['prefill_peak'] / grp['prefill_peak']:.2f}x, bytes per pull {one['pull'] / grp['pull']:.2f}x; "
              f"{args.memory_gib:g} GiB holds {memory // one['decode_peak']} / {memory // grp['decode_peak']} "
              "such decodes")
    if args.repeats:
        windows, _, head_dim = SHAPES["gemma3-27b"]
        timed = asyncio.run(time_pulls(windows, args.time_kv_heads, head_dim, args.time_prompt, args.block_size,
                                       args.repeats))
        print(f"pull of a held {args.time_prompt}-token prompt over gRPC on 127.0.0.1, gemma3-27b layers with "
              f"{args.time_kv_heads} KV heads, median of {args.repeats}:")
        for arm, (seconds, num_bytes) in timed.items():
            print(f"  {arm:<10} {num_bytes / MiB:>9,.1f} MiB {seconds:>8.3f} s")
        (s1, b1), (s2, b2) = timed["one group"], timed["groups"]
        print(f"  one/groups: bytes {b1 / b2:.2f}x, time {s1 / s2:.2f}x")


if __name__ == "__main__":
    main()
