"""Prefill pod overhead: a real prefill pod's prefill step against the same engine offline.

A prefill pod process (`cbserve prefill`, tiny, `--threads` torch threads) serves `--requests`
prompts, `--concurrency` at a time, from a grpc.aio client in this process, as decode pods use it:
`Prefill`, then a whole `PullKV` stream over gRPC (the client throws the KV away). The pod's step
samples come from WatchLoad; the same engine runs the same prompts offline in a subprocess (all
queued at once, held KV released after every step, as a finished pull releases it). Compared:
the median time of steps that prefill a full chunk (`--max-num-batched-tokens` tokens), which
have the same work in both, so the difference is what serving adds inside the step: the gRPC
server's Python (handlers, KV chunks, grpc.aio) holding the GIL the engine thread needs, and CPU
the server takes from the engine on a small machine. Also reported, medians per request: the time
to the first token (the `Prefill` call) and how long the KV's stream ran on after it (what a
decode pod waits for beyond the first token: the transfer in the prefill→decode gap); and the
pod's CPU per request, in all (its processes: the server and its engine core) and in the
server's event-loop (main) thread.

    .venv/bin/python bench/prefill_overhead.py [--tree NAME=PATH ...] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from pod_overhead import (BENCH_SECRET, add_workload_arguments, cpu_seconds, pod_and_offline,  # noqa: E402
                          timed_with_samples, tree_cpu_seconds, tree_env, wait_ready, workload)


def engine_flags(args) -> list[str]:
    return ["--model", args.model, "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--num-blocks", str(args.num_blocks)]


def offline(args) -> dict:
    import torch

    from cbserve.cli import build_parser, engine_config_from_args
    from engine.engine import Engine
    from engine.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    config = engine_config_from_args(build_parser().parse_args(["prefill", *engine_flags(args)]), "prefill")
    engine = Engine(config)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for seed, prompts in ((1, workload(args, args.concurrency, seed=1)), (0, workload(args))):
        engine.reset_step_stats()
        samples = []
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=f"{seed}-{i}")
        while engine.has_unfinished_requests():
            steps = engine.num_steps
            engine.step()
            if engine.num_steps != steps:
                samples.append(engine.step_samples[-1])
            for request_id in list(engine.scheduler.held):
                engine.scheduler.release_request(request_id)
    return chunk_stats(samples, args)


def chunk_stats(samples, args) -> dict:
    full = [s.seconds for s in samples if s.num_prefill_tokens == args.max_num_batched_tokens]
    return {"full_chunk_ms": 1e3 * statistics.median(full) if full else float("nan"), "num_full_chunks": len(full)}


async def drive(address: str, prompts: list[list[int]], args, tag: str) -> dict:
    import grpc

    from engine.sampling.params import SamplingParams, to_proto
    from kvtransfer.handles import KVHandles
    from wire import cbserve_pb2 as pb
    from wire import cbserve_pb2_grpc as pb_grpc

    sampling = to_proto(SamplingParams(temperature=0.0, max_tokens=1))
    handles = KVHandles.from_secret(BENCH_SECRET)
    auth = (("authorization", f"Bearer {BENCH_SECRET}"),)
    gate = asyncio.Semaphore(args.concurrency)
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)]) as ch:
        stub = pb_grpc.PrefillServiceStub(ch)
        model = (await stub.Handshake(pb.HandshakeRequest(), metadata=auth)).model

        async def one(i: int, prompt: list[int]) -> tuple[int, float, float]:
            """KV bytes; seconds from the call to the first token; from the first token to the KV's end."""
            async with gate:
                req_id = f"{tag}-{i}"
                started = time.perf_counter()
                first_token_at = []

                async def first_token():
                    await stub.Prefill(pb.PrefillRequest(request_id=req_id, prompt_token_ids=prompt, sampling=sampling),
                                       metadata=auth, timeout=600)
                    first_token_at.append(time.perf_counter())

                prefill = asyncio.ensure_future(first_token())
                pull = pb.PullKVRequest(request_id=req_id, model=model, transport="grpc")
                pull.kv_handle.CopyFrom(handles.issue(req_id, address, time.time() + 600))
                size = 0
                async for chunk in stub.PullKV(pull, metadata=auth, timeout=600):
                    size += chunk.ByteSize()
                pulled = time.perf_counter()
                await prefill
                return size, first_token_at[0] - started, max(0.0, pulled - first_token_at[0])

        done, elapsed, samples = await timed_with_samples(
            stub, auth, lambda: asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    return {"requests_per_s": len(prompts) / elapsed, "kv_mb": sum(d[0] for d in done) / 1e6,
            "first_token_ms": 1e3 * statistics.median(d[1] for d in done),
            "kv_after_first_token_ms": 1e3 * statistics.median(d[2] for d in done), **chunk_stats(samples, args)}


def measure_tree(path: Path, args) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.pods.podproc import free_port

    port = free_port()
    log = Path(tempfile.mkstemp(prefix="prefill-overhead-", suffix=".log")[1])
    env = {**tree_env(path, args), "CBSERVE_CLUSTER_SECRET": BENCH_SECRET}
    proc = subprocess.Popen([sys.executable, "-m", "cbserve.cli", "--log-level", "WARNING", "prefill",
                             "--port", str(port), "--advertise-address", f"127.0.0.1:{port}", *engine_flags(args)],
                            cwd=path, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"

    async def scenario():
        await wait_ready(proc, address, log)
        await drive(address, workload(args, args.concurrency, seed=1), args, "warm")
        cpu0, loop0 = tree_cpu_seconds(proc.pid), cpu_seconds(proc.pid, proc.pid)
        result = await drive(address, workload(args), args, "run")
        result["pod_cpu_ms_per_request"] = 1e3 * (tree_cpu_seconds(proc.pid) - cpu0) / args.requests
        result["loop_cpu_ms_per_request"] = 1e3 * (cpu_seconds(proc.pid, proc.pid) - loop0) / args.requests
        return result

    return pod_and_offline(path, args, proc, scenario, Path(__file__))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH")
    add_workload_arguments(p, requests=192, num_blocks=4096)
    args = p.parse_args()
    if args.offline:
        print(json.dumps(offline(args)))
        return
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree] or [("this", ROOT)]
    results: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for r in range(args.rounds):
        for name, path in trees:
            row = measure_tree(path, args)
            results[name].append(row)
            print(json.dumps({"round": r, "tree": name, **row}), flush=True)

    def med(rows, side, key):
        return statistics.median(row[side][key] for row in rows)

    print("| tree | requests/s | first token ms | KV after first token ms | pod CPU ms/request "
          "| loop thread CPU ms/request | pod full-chunk step ms | offline full-chunk step ms | pod / offline |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        pod, off = med(rows, "pod", "full_chunk_ms"), med(rows, "offline", "full_chunk_ms")
        print(f"| {name} | {med(rows, 'pod', 'requests_per_s'):.1f} | {med(rows, 'pod', 'first_token_ms'):.2f} "
              f"| {med(rows, 'pod', 'kv_after_first_token_ms'):.2f} | {med(rows, 'pod', 'pod_cpu_ms_per_request'):.2f} "
              f"| {med(rows, 'pod', 'loop_cpu_ms_per_request'):.2f} | {pod:.2f} | {off:.2f} | {pod / off:.2f}x |")


if __name__ == "__main__":
    main()
