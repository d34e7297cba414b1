"""Pod overhead on the token path: a real decode pod (colocated, `tiny`) vs the same engine offline.

A decode pod process (`cbserve decode --colocated`) serves `--requests` requests, `--concurrency`
at a time, from a grpc.aio client in this process, as the router sends them: on one `Session`
(the router's own `DecodeSession`), or, for a tree named `NAME=PATH@generate` (checkouts from before
the Session), one `Generate` stream per request: greedy, ignore_eos,
`--prompt-len`-token prompts, `--output-len` output tokens each. Reported per tree:
- output tokens/s, end to end, and the pod's CPU µs per output token (/proc/<pid>/stat, utime +
  stime, read around the measured batch only; a warm-up batch comes first), in all (the pod's
  process and its engine-core process) and in the server's main thread alone: the event loop,
  where the gRPC handlers run (the engine has its own thread, in its own process since the engine
  core);
- mean tokens per gRPC message from the pod (1.0 = one message per token; a Session message
  carries every request that moved in a step, so it goes above 1 with concurrency);
- the pod's mean engine step time from its LoadReport step samples (WatchLoad), decode-only steps
  and all steps, against the same engine run offline in a subprocess on the same workload with
  the same concurrency (closed loop), its step times read the same way (`engine.step_samples`).

`--tree NAME=PATH` runs the pod and the offline engine from another checkout (PYTHONPATH=PATH;
this driver and its protobuf stubs always come from this checkout: the wire format is shared),
so a base and a changed pod are measured side by side in one run, alternating, `--rounds` times;
the table shows medians.

    git worktree add /tmp/pod-base <commit before the change>
    .venv/bin/python bench/pod_overhead.py --tree base=/tmp/pod-base@generate --tree new=. --rounds 3

On a shared CPU the absolute figures mean little; compare trees, and the pod step against the
offline step of the same tree (the difference is what serving adds inside the step: GIL
contention with the pod's event loop, hooks between steps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_SECRET = "pod-overhead-bench-secret"   # the pods this bench starts answer only it


def workload(args, n: int | None = None, seed: int = 0) -> list[list[int]]:
    """Random prompts (no shared prefixes); the warm-up batch gets its own seed, so the measured
    prompts are never in the prefix cache."""
    rng = random.Random(args.seed * 1000 + seed)
    return [[1] + [rng.randrange(4, 260) for _ in range(args.prompt_len - 1)] for _ in range(n or args.requests)]


def engine_flags(args) -> list[str]:
    return ["--model", args.model, "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-num-seqs", str(args.max_num_seqs), "--num-blocks", str(args.num_blocks)]


def tree_env(path: Path, args) -> dict:
    return {**os.environ, "PYTHONPATH": str(path), "CBSERVE_NUM_THREADS": str(args.threads),
            "CBSERVE_CACHE_DIR": os.environ.get("CBSERVE_CACHE_DIR", str(ROOT / ".cache"))}


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process, or of one of its threads."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """`cpu_seconds` of a process and its descendants (a decode pod's engine core is its child)."""
    total = cpu_seconds(pid)
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
            total += tree_cpu_seconds(int(child))
    return total


async def timed_with_samples(stub, auth, run):
    """`await run()`, timed, with the pod's step samples (WatchLoad) from its start to its end:
    (result, seconds, samples)."""
    from wire import cbserve_pb2 as pb

    samples = []

    async def watch() -> None:
        async for report in stub.WatchLoad(pb.WatchLoadRequest(interval_seconds=0.02), metadata=auth):
            samples.extend(report.step_samples)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.1)
    samples.clear()                 # what the pod did before this batch
    t0 = time.perf_counter()
    result = await run()
    elapsed = time.perf_counter() - t0
    await asyncio.sleep(0.15)       # the snapshot's last refresh (timer-based pods)
    watcher.cancel()
    return result, elapsed, samples


# ---------------------------------------------------------------------- offline (subprocess)
def offline(args) -> dict:
    """The pod's engine config in this process, the workload closed-loop at `--concurrency`."""
    import dataclasses

    import torch

    from engine.config import CacheConfig, SchedulerConfig
    from engine.engine import Engine, EngineConfig
    from engine.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    lean = {"detokenize": False} if "detokenize" in fields else {}   # as the tree's pods run it
    engine = Engine(EngineConfig(model=args.model, role="decode", cache=CacheConfig(num_blocks=args.num_blocks),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                                           max_num_seqs=args.max_num_seqs), **lean))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompts = workload(args)
    engine.generate(workload(args, args.concurrency, seed=1), params)    # warm-up, as the pod's batch
    engine.reset_step_stats()
    samples, pending, in_flight, tokens = [], list(prompts), 0, 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < args.concurrency:
            engine.add_request(pending.pop(), params)
            in_flight += 1
        steps = engine.num_steps
        outputs = engine.step()
        if engine.num_steps != steps:
            samples.append(engine.step_samples[-1])
        tokens += sum(len(o.new_token_ids) for o in outputs)
        in_flight -= sum(o.finished for o in outputs)
    elapsed = time.perf_counter() - t0
    return {"tokens_per_s": tokens / elapsed, **step_means(samples), "detokenize": not lean}


def step_means(samples) -> dict:
    decode = [s.seconds for s in samples if s.num_prefill_tokens == 0]
    return {"step_ms": 1e3 * statistics.fmean(s.seconds for s in samples) if samples else float("nan"),
            "decode_step_ms": 1e3 * statistics.fmean(decode) if decode else float("nan"),
            "num_steps": len(samples)}


# ---------------------------------------------------------------------- pod
def start_pod(path: Path, args) -> tuple[subprocess.Popen, str, Path]:
    sys.path.insert(0, str(ROOT))
    from tests.pods.podproc import free_port

    port = free_port()
    log = Path(tempfile.mkstemp(prefix="pod-overhead-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "cbserve.cli", "--log-level", "WARNING", "decode", "--colocated",
           "--port", str(port), *engine_flags(args)]
    # The pod requires the deployment secret on every call (drive() sends it; trees from before it ignore it).
    env = {**tree_env(path, args), "CBSERVE_CLUSTER_SECRET": BENCH_SECRET}
    proc = subprocess.Popen(cmd, cwd=path, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"127.0.0.1:{port}", log


async def wait_ready(proc, address: str, log: Path, timeout: float = 180.0) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"pod exited:\n{log.read_text()[-3000:]}")
            try:
                if (await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"pod not ready:\n{log.read_text()[-3000:]}")


async def drive(address: str, prompts: list[list[int]], args, tag: str, api: str) -> dict:
    """Every prompt through the pod, `--concurrency` at a time, on one Session (`api="session"`) or
    one Generate stream each (`api="generate"`); step samples via WatchLoad."""
    import grpc

    from wire import cbserve_pb2 as pb
    from wire import cbserve_pb2_grpc as pb_grpc
    from engine.sampling.params import SamplingParams, to_proto
    from router.pod_session import DecodeSession

    sampling = to_proto(SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True))
    gate = asyncio.Semaphore(args.concurrency)
    auth = (("authorization", f"Bearer {BENCH_SECRET}"),)   # per call, as the router sends it
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.DecodeServiceStub(ch)
        session = DecodeSession(stub, address, inactivity_seconds=600, metadata=auth) if api == "session" else None

        async def one(i: int, prompt: list[int]) -> tuple[int, int]:
            async with gate:
                messages = tokens = 0
                request = pb.GenerateRequest(request_id=f"{tag}-{i}", prompt_token_ids=prompt, sampling=sampling)
                if session is not None:
                    call = session.generate(request, timeout=600)
                    while True:
                        m = await call.read()
                        tokens += len(m.token_ids)
                        if m.finished:
                            break
                else:
                    async for m in stub.Generate(request, timeout=600, metadata=auth):
                        messages += 1
                        tokens += len(m.token_ids)
                assert tokens == args.output_len, tokens
                return messages, tokens

        messages0 = session.num_messages if session is not None else 0
        results, elapsed, samples = await timed_with_samples(
            stub, auth, lambda: asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        if session is not None:
            session.close()
    messages, tokens = sum(m for m, _ in results), sum(t for _, t in results)
    if session is not None:
        messages = session.num_messages - messages0
    return {"tokens_per_s": tokens / elapsed, "tokens_per_message": tokens / messages, "tokens": tokens,
            **step_means(samples)}


def measure_tree(path: Path, args, api: str) -> dict:
    proc, address, log = start_pod(path, args)

    async def scenario():
        await wait_ready(proc, address, log)
        await drive(address, workload(args, args.concurrency, seed=1), args, "warm", api)
        cpu0, loop0 = tree_cpu_seconds(proc.pid), cpu_seconds(proc.pid, proc.pid)
        result = await drive(address, workload(args), args, "run", api)
        result["pod_cpu_us_per_token"] = 1e6 * (tree_cpu_seconds(proc.pid) - cpu0) / result["tokens"]
        result["loop_cpu_us_per_token"] = 1e6 * (cpu_seconds(proc.pid, proc.pid) - loop0) / result["tokens"]
        return result

    return pod_and_offline(path, args, proc, scenario, Path(__file__))


def pod_and_offline(path: Path, args, proc: subprocess.Popen, scenario, script: Path) -> dict:
    """`scenario()` against the running pod `proc` (stopped afterwards), then `script --offline`
    with this command line in the tree at `path`: {"pod": ..., "offline": ...}."""
    try:
        pod = asyncio.run(scenario())
    finally:
        proc.terminate()
        proc.wait(30)
    run = subprocess.run([sys.executable, str(script.resolve()), "--offline", *sys.argv[1:]],
                         cwd=path, env=tree_env(path, args), capture_output=True, text=True, check=True)
    return {"pod": pod, "offline": json.loads(run.stdout.strip().splitlines()[-1])}


def table(results: dict[str, list[dict]]) -> str:
    def med(rows, side, key):
        return statistics.median(r[side][key] for r in rows)

    cols = [("pod tok/s", "pod", "tokens_per_s", "{:.0f}"), ("tok/msg", "pod", "tokens_per_message", "{:.2f}"),
            ("pod CPU us/tok", "pod", "pod_cpu_us_per_token", "{:.0f}"),
            ("loop thread CPU us/tok", "pod", "loop_cpu_us_per_token", "{:.1f}"),
            ("pod step ms", "pod", "step_ms", "{:.2f}"), ("pod decode step ms", "pod", "decode_step_ms", "{:.2f}"),
            ("offline step ms", "offline", "step_ms", "{:.2f}"),
            ("offline decode step ms", "offline", "decode_step_ms", "{:.2f}"),
            ("offline tok/s", "offline", "tokens_per_s", "{:.0f}")]
    lines = ["| tree | " + " | ".join(c[0] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, rows in results.items():
        lines.append(f"| {name} | " + " | ".join(fmt.format(med(rows, side, key)) for _, side, key, fmt in cols) + " |")
    return "\n".join(lines)


def add_workload_arguments(p: argparse.ArgumentParser, requests: int, num_blocks: int) -> None:
    """The flags a pod-vs-offline bench shares (this one and `prefill_overhead.py`)."""
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=requests)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--model", default="tiny")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the pod and the offline engine")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-blocks", type=int, default=num_blocks)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offline", action="store_true", help=argparse.SUPPRESS)   # the subprocess side


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH[@generate]",
                   help="a checkout to run the pod and the offline engine from (default: this one); "
                        "@generate drives it with one Generate stream per request instead of a Session")
    add_workload_arguments(p, requests=128, num_blocks=2048)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=128)
    args = p.parse_args()
    if args.offline:
        sys.path.insert(0, os.getcwd())        # the tree's engine, not this checkout's
        print(json.dumps(offline(args)))
        return
    sys.path.insert(0, str(ROOT))
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(ROOT)}
    results: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, spec in trees.items():
            path, _, api = spec.partition("@")
            result = measure_tree(Path(path).resolve(), args, api or "session")
            results[name].append(result)
            print(json.dumps({"round": r, "tree": name, **result}), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
