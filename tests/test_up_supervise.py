"""`cbserve up` supervises like a kubelet (issue 11, case 5: kill -9 of one pod shut the whole local
cluster down; the router refused connections ~7 s later).

Real processes on loopback: router + 1 prefill + 2 decode pods (tiny model). kill -9 of a decode pod:
every request keeps succeeding, the pod is restarted at its address, the router routes to it again;
kill -9 of the router: it comes back on its port.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from cbserve.cluster_spec import ClusterSpec
from cbserve.local_cluster import LocalCluster
from cbserve.readiness import grpc_serving, http_ready
from tests.cluster_routing import requests_served, until_every_pod_served

pytestmark = pytest.mark.slow
BODY = {"model": "tiny", "prompt": "Supervised", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_killed_decode_pod_and_router_come_back_while_requests_keep_succeeding():
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=2, port=0, threads_per_pod=1, policy="round_robin",
                       drain_seconds=2, startup_timeout=240,
                       router_args=("--max-queue-seconds", "10", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000"))
    with LocalCluster(spec) as cluster:
        cluster.supervise_in_background(interval=0.2)
        until_every_pod_served(cluster, BODY)

        def complete() -> str:
            response = httpx.post(cluster.base_url + "/completions", json=BODY, timeout=60)
            assert response.status_code == 200, response.text
            return json.loads(response.text)["choices"][0]["text"]

        expected = complete()
        procs = cluster.processes
        pids = {name: proc.pid for name, proc in procs.items()}
        decode0 = next(p for p in cluster.pods if p.name == "decode-0")
        procs["decode-0"].send(signal.SIGKILL)

        # Requests keep succeeding on the other decode pod while decode-0 is down and restarting.
        num_requests = 0
        deadline = time.monotonic() + 120
        while not (cluster.restarts("decode-0") and grpc_serving(decode0.address)):
            assert time.monotonic() < deadline, "decode-0 was not restarted"
            assert complete() == expected
            num_requests += 1
        assert num_requests > 0
        assert procs["decode-0"].pid != pids["decode-0"]
        assert all(procs[name].pid == pid for name, pid in pids.items() if name != "decode-0")

        # The router takes the restarted pod back (static discovery: same address) and it serves.
        _until(lambda: complete() == expected and requests_served(decode0.metrics_url) > 0, 60,
               "the restarted decode-0 to serve")

        procs["router"].send(signal.SIGKILL)
        _until(lambda: cluster.restarts("router") == 1 and http_ready(cluster.url + "/ready"), 90, "the router back")
        assert complete() == expected
