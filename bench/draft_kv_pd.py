"""P/D with a draft model, end to end: the prefill pod ships the draft's KV, or the decode pod prefills it.

    python bench/draft_kv_pd.py            # tiny target and draft (a 2,048-token context): 512/1024/1536-token prompts
    python bench/draft_kv_pd.py --prompt-tokens 1024 --rounds 5 --max-tokens 16

Real pods on loopback, as the tests start them (`tests.pods.podproc`): one decode pod with
`--speculative-config` draft_model, and two prefill pods, one without the draft (the decode pod
prefills its draft from the prompt on its first speculative step) and one with it (it prefills the
draft beside the target and ships its KV in the pull: `kvtransfer.draft_kv`). Each round sends one
request per prompt length through each arm, alternating arms, one at a time (greedy,
`--max-tokens` tokens); with `--background-tokens N`, while a background request decodes on the
same decode pod (prefilled there, N tokens, restarted when it ends): the batch that a decode pod's
draft prefill stalls. Per request:
  prefill  Prefill's answer, the first token (what the router streams first): the shipping
           arm's prefill step also runs the draft's forward (after sampling; on CPU it delays
           the step's end all the same)
  ttft     Generate's first token (prefill, pull, landing): the shipping arm's pull also moves
           the draft's bytes
  decode   first token -> last token: the decode pod's steps, whose first speculative one
           catches the draft up over the prompt in the other arm
  e2e      the request's whole time
  stall    the longest gap between the background request's messages while the request ran
           (with a background request)
  cpu      the decode pod's CPU seconds meanwhile (its server and engine-core processes, /proc;
           without a background request: the request's own cost there)
Medians over `--rounds`, shipped/decode-prefill ratios. Run it under the exclusive CPU lock.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.pod_overhead import tree_cpu_seconds  # noqa: E402
from tests.pods.podproc import Pod, dispatch, pod_channel, sampling  # noqa: E402
from wire import cbserve_pb2 as pb, cbserve_pb2_grpc as pb_grpc  # noqa: E402

ARMS = ("prefilled-on-decode", "shipped")
KEYS = ("prefill", "ttft", "decode", "e2e", "stall", "cpu")


async def background(decode: Pod, arrivals: list[float], stop: asyncio.Event, max_tokens: int) -> None:
    """A request decoding on `decode` the whole time (local prefill), its messages' arrival times."""
    params = sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async with pod_channel(decode.address) as channel:
        for i in range(1 << 30):
            stream = pb_grpc.DecodeServiceStub(channel).Generate(pb.GenerateRequest(
                request_id=f"background-{i}", prompt_token_ids=[1] + list(range(4, 20)), sampling=params), timeout=600)
            async for _ in stream:
                arrivals.append(time.perf_counter())
                if stop.is_set():
                    stream.cancel()
                    return


async def one(prefill: Pod, decode: Pod, request_id: str, prompt: list[int], max_tokens: int,
              arrivals: list[float]) -> dict:
    params = sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    cpu0 = tree_cpu_seconds(decode.proc.pid)
    async with pod_channel(prefill.address) as pc, pod_channel(decode.address) as dc:
        start = time.perf_counter()
        pre, gen = dispatch(pc, dc, prefill.address, request_id, prompt, params, timeout=300)
        pre = asyncio.ensure_future(pre)
        prefilled: list[float] = []
        pre.add_done_callback(lambda _: prefilled.append(time.perf_counter()))
        first_at = shipped = None
        tokens = 0
        async for message in gen:
            if first_at is None:
                first_at, shipped = time.perf_counter(), message.draft_kv_shipped
                assert not message.local_prefill, "the pull failed: not a P/D request"
            tokens += len(message.token_ids)
        end = time.perf_counter()
        await pre
    assert tokens == max_tokens
    during = [t for t in arrivals if t >= start] + [end] if arrivals else []
    return {"prefill": prefilled[0] - start, "ttft": first_at - start, "decode": end - first_at,
            "e2e": end - start, "stall": max((b - a for a, b in zip(during, during[1:])), default=0.0),
            "shipped": shipped, "cpu": tree_cpu_seconds(decode.proc.pid) - cpu0}


async def measure(args, pods: dict[str, Pod], lengths: list[int]) -> dict[tuple[str, int], list[dict]]:
    arrivals: list[float] = []
    stop = asyncio.Event()
    task = asyncio.create_task(background(pods["decode"], arrivals, stop, args.background_tokens)) \
        if args.background_tokens else None
    rng = random.Random(0)
    results: dict[tuple[str, int], list[dict]] = {}
    try:
        while task is not None and not arrivals:
            await asyncio.sleep(0.05)
        for r in range(args.rounds + 1):
            for n in lengths:
                for arm in (ARMS if r % 2 else ARMS[::-1]):   # alternate which arm goes first
                    prompt = [1] + [rng.randrange(4, 260) for _ in range(n - 1)]   # no prefix-cache hits
                    out = await one(pods[arm], pods["decode"], f"{arm}-{n}-{r}", prompt, args.max_tokens, arrivals)
                    assert out["shipped"] == (arm == "shipped"), out
                    if r:
                        results.setdefault((arm, n), []).append(out)
    finally:
        stop.set()
        if task is not None:
            await asyncio.wait_for(task, 60)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--draft", default="tiny")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--prompt-tokens", default="512,1024,1536")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--background-tokens", type=int, default=0, help="0: no background request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    spec = (f'{{"method": "draft_model", "model": "{args.draft}", '
            f'"num_speculative_tokens": {args.num_speculative_tokens}}}')
    max_len = max(max(lengths) + args.max_tokens, args.background_tokens + 32) + 64
    common = ("--model", args.model, "--max-model-len", str(max_len), "--num-blocks", str(4 * (max_len // 16 + 64)))
    # podproc's Pod passes --max-num-batched-tokens 64 first; the later flag wins (argparse).
    budget = ("--max-num-batched-tokens", str(args.max_num_batched_tokens))
    pods = {"decode": Pod("decode", *common, *budget, "--speculative-config", spec),
            ARMS[0]: Pod("prefill", *common, *budget),
            ARMS[1]: Pod("prefill", *common, *budget, "--speculative-config", spec)}
    try:
        for pod in pods.values():
            pod.wait_ready(timeout=300)
        print(f"target {args.model}, draft {args.draft}, k={args.num_speculative_tokens}, "
              f"{args.max_tokens} output tokens, {args.rounds} rounds (one more warms up, dropped), "
              + (f"a background decode of {args.background_tokens} tokens" if args.background_tokens else "alone"))
        results = asyncio.run(measure(args, pods, lengths))
        print(f"{'tokens':>7} {'arm':<20} " + " ".join(f"{k + (' CPU s' if k == 'cpu' else ' s'):>10}" for k in KEYS))
        for n in lengths:
            med = {arm: {k: statistics.median(o[k] for o in results[(arm, n)]) for k in KEYS} for arm in ARMS}
            for arm in ARMS:
                print(f"{n:>7} {arm:<20} " + " ".join(f"{med[arm][k]:>10.3f}" for k in KEYS))
            a, b = med[ARMS[0]], med[ARMS[1]]
            print(f"{n:>7} {'shipped / decode':<20} " + " ".join(f"{b[k] / a[k] if a[k] else 0:>10.2f}" for k in KEYS),
                  flush=True)
    finally:
        for pod in pods.values():
            pod.stop()


if __name__ == "__main__":
    main()
