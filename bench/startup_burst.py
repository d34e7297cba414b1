"""A burst of requests sent the moment `cbserve up` is launched: are they all served? (issue 20)

Starts the real `cbserve up` (tiny model, 1 prefill + 1 decode) as a subprocess and, at the same
instant, `--burst` concurrent completions with the `openai` client as a user would configure it
(its default retries: 2, with backoff, honouring Retry-After). Each request ends served (200), or
refused with 503 and Retry-After once its wait bound (`--startup-wait-seconds`) passed, or failed
(anything else: a refused connection, a 5xx without Retry-After, a timeout). The target is zero
failed. Then `cbserve up` is stopped with SIGTERM, as Ctrl-C does.

    python -m bench.startup_burst                      # 3 rounds of 16 requests
    python -m bench.startup_burst --rounds 3 --burst 16 --startup-wait-seconds 120
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):   # `python bench/startup_burst.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openai

from cbserve.local_cluster import free_ports


def one_request(base_url: str, index: int) -> tuple[str, float]:
    """(outcome, seconds): "served", "503+retry-after", or "failed: <why>"."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=600)   # default max_retries=2
    start = time.monotonic()
    try:
        client.completions.create(model="tiny", prompt=f"Request {index} at startup", max_tokens=8, temperature=0.0)
        return "served", time.monotonic() - start
    except openai.APIStatusError as e:
        if e.status_code == 503 and "retry-after" in e.response.headers:
            return "503+retry-after", time.monotonic() - start
        return f"failed: {e.status_code} {e.message[:80]}", time.monotonic() - start
    except openai.APIError as e:
        return f"failed: {type(e).__name__}", time.monotonic() - start


def one_round(args: argparse.Namespace, log_dir: Path) -> tuple[collections.Counter, list[float], float]:
    (port,) = free_ports(1)
    env = {**os.environ, "CBSERVE_NUM_THREADS": "1"}
    with open(log_dir / f"up-{port}.log", "w") as log:
        up = subprocess.Popen([sys.executable, "-m", "cbserve.cli", "up", "--port", str(port), "--model", "tiny",
                               "--startup-wait-seconds", str(args.startup_wait_seconds), "--threads-per-pod", "1",
                               "--drain-seconds", "2"], stdout=log, stderr=subprocess.STDOUT, env=env)
        launched = time.monotonic()
        try:
            with ThreadPoolExecutor(args.burst) as pool:
                results = list(pool.map(lambda i: one_request(f"http://127.0.0.1:{port}/v1", i), range(args.burst)))
        finally:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
    outcomes = collections.Counter(outcome for outcome, _ in results)
    return outcomes, [seconds for _, seconds in results], time.monotonic() - launched


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--startup-wait-seconds", type=float, default=60.0)
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="cbserve-startup-burst-"))
    failed = 0
    for round_ in range(1, args.rounds + 1):
        outcomes, seconds, wall = one_round(args, log_dir)
        failed += sum(n for outcome, n in outcomes.items() if outcome.startswith("failed"))
        print(f"round {round_}: {dict(outcomes)}; request seconds min {min(seconds):.1f} max {max(seconds):.1f}; "
              f"round {wall:.0f} s", flush=True)
    print(f"failed requests: {failed} (target 0); logs in {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
