"""The prefill side (rank 0) of a Gloo pair, in its own process, for the collective tests.

Usage: python kv_pair_proc.py STORE_PORT GROUP MODE
  runs   send the runs of `RUNS` (two requests, interleaved) from `make_kv(seed=1)`, then close
  serve  serve PullKV (transport "nccl" over the pair) for request "r": 22 tokens, finished;
         prints the gRPC port
  hang   send one run, print "sent", then wait to be killed or stopped
  receiver  join as rank 1 (the decode side) instead, print "joined", wait to be killed
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_helpers import TINY, make_kv  # noqa: E402

from kvtransfer.collective import PairGroup, connect_store  # noqa: E402
from kvtransfer.packing import Run, run_tensor  # noqa: E402

# (request id, first block index, first block id, num blocks)
RUNS = [("a", 0, 1, 3), ("b", 0, 7, 2), ("a", 3, 12, 1), ("b", 2, 4, 3)]
SERVE_IDS = [2, 3, 4, 9, 10, 5]


async def main(store_port: int, group_name: str, mode: str) -> None:
    kv = make_kv(TINY, num_blocks=16, seed=1)
    store = connect_store("127.0.0.1", store_port, timeout_s=10)
    group = await PairGroup.create(store, group_name, rank=1 if mode == "receiver" else 0,
                                   backend="gloo", timeout_s=3, heartbeat_s=0.2)
    if mode == "receiver":
        print("joined", flush=True)
        await asyncio.sleep(3600)
    elif mode == "runs":
        for request_id, index, first_id, count in RUNS:
            await group.send_run(request_id, index, run_tensor(kv, Run(index, count, first_id)))
        group.close()
    elif mode == "hang":
        await group.send_run("h", 0, run_tensor(kv, Run(0, 2, 1)))
        print("sent", flush=True)
        await asyncio.sleep(3600)
    elif mode == "serve":
        from kvtransfer.testing import PullKVServicer, start_server

        servicer = PullKVServicer(kv, TINY.to_model_info("tiny", "fp-tiny"), groups={group_name: group})
        servicer.add_request("r", num_prompt_tokens=22).finish(11, SERVE_IDS)
        server, port = await start_server(servicer)
        print(port, flush=True)
        await asyncio.wait_for(servicer.closed["r"].wait(), 30)
        print(servicer.outcomes["r"], flush=True)
        group.close()
        await server.stop(1)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
