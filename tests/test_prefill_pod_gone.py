"""The only prefill pod gone (issue 11, case 6): decode pods prefill locally, on by default; with
`--no-local-prefill-fallback` a request waits for the prefill pod to come back, at most
`--startup-wait-seconds` (issue 20: a crashed pod is usually restarting), then gets 503 with
Retry-After (issue 11 saw a 503 after a 5 s queue wait that said nothing about coming back).

Real processes on loopback: a local cluster (router + 1 prefill + 1 decode pod, tiny model), then
kill -9 of the prefill pod, plus a second router with the fallback off on the same pods.
"""

from __future__ import annotations

import signal
import sys
import time

import httpx
import pytest

from cbserve.cluster_spec import ClusterSpec
from cbserve.local_cluster import LocalCluster, free_ports
from cbserve.processes import ManagedProcess, child_env, stop_group
from cbserve.readiness import http_ready
from pod.auth import SECRET_ENV

pytestmark = pytest.mark.slow
STARTUP_WAIT_SECONDS = 2
BODY = {"model": "tiny", "prompt": "The prefill pod is gone", "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True}


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_decode_pods_prefill_locally_when_no_prefill_pod_is_left():
    spec = ClusterSpec(model="tiny", port=0, threads_per_pod=1, drain_seconds=2, startup_timeout=240,
                       router_args=("--max-queue-seconds", "5"))
    with LocalCluster(spec) as cluster:
        reference = httpx.post(cluster.base_url + "/completions", json=BODY, timeout=60)
        assert reference.status_code == 200, reference.text
        prefill, decode = (p for p in cluster.pods)
        cluster.processes["prefill-0"].send(signal.SIGKILL)
        cluster.processes["prefill-0"].wait(10)

        (port,) = free_ports(1)
        strict = ManagedProcess("strict-router", [sys.executable, "-m", "cbserve.cli", "router", "--model", "tiny",
                                                  "--host", "127.0.0.1", "--port", str(port),
                                                  "--prefill", prefill.address, "--decode", decode.address,
                                                  "--no-local-prefill-fallback", "--startup-wait-seconds",
                                                  str(STARTUP_WAIT_SECONDS)],
                                # The cluster's deployment secret, as `cbserve up` hands it to its router.
                                child_env(1, {SECRET_ENV: cluster.cluster_secret}))
        strict.start()
        try:
            for _ in range(3):
                response = httpx.post(cluster.base_url + "/completions", json=BODY, timeout=60)
                assert response.status_code == 200, response.text
                # Greedy: the same text as with the prefill pod.
                assert response.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
            assert http_ready(cluster.url + "/ready")
            metrics = httpx.get(decode.metrics_url, timeout=5).text
            assert "cbserve_requests_total" in metrics

            # The router without the fallback: not ready; a request waits for the prefill pod for
            # its bound, then 503 with Retry-After.
            url = f"http://127.0.0.1:{port}"
            _wait(lambda: _up(url), 120, "the strict router")
            assert not http_ready(url + "/ready")
            start = time.monotonic()
            refused = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
            elapsed = time.monotonic() - start
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_ready_pods"
            assert "retry-after" in refused.headers
            assert STARTUP_WAIT_SECONDS <= elapsed < STARTUP_WAIT_SECONDS + 30, f"503 after {elapsed:.1f}s"
        finally:
            stop_group([strict], 10)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
