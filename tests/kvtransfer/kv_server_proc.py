"""A PullKV server in its own process, for the "prefill pod dies mid-stream" test.

Usage: python kv_server_proc.py  -> prints the port on stdout, then serves request "r" with
40 prompt tokens of which the first 16 are computed; prefill never finishes.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_helpers import TINY, make_kv  # noqa: E402

from kvtransfer.testing import PullKVServicer, start_server  # noqa: E402


async def main() -> None:
    kv = make_kv(TINY, num_blocks=16)
    servicer = PullKVServicer(kv, TINY.to_model_info("tiny", "fp-tiny"))
    progress = servicer.add_request("r", num_prompt_tokens=40)
    progress.advance(16, list(range(1, 11)))
    server, port = await start_server(servicer)
    print(port, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
