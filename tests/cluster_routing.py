"""Waiting until a local cluster's router routes to every pod (for tests that then break one).

The router's `/ready` needs one pod that can take a request (a decode pod prefills locally when no
prefill pod is routable), so it can be ready before it has admitted every pod. A test that freezes
or kills one pod must first know the others are in routing, or it measures startup, not failover.
"""

from __future__ import annotations

import re
import time

import httpx

from cbserve.local_cluster import LocalCluster


def requests_served(metrics_url: str) -> float:
    """Requests the pod behind `metrics_url` finished (its own counter: it restarts with the pod)."""
    try:
        page = httpx.get(metrics_url, timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(v) for v in re.findall(r"^cbserve_requests_total\{[^}]*\} (\S+)$", page, re.M))


def until_every_pod_served(cluster: LocalCluster, body: dict, timeout: float = 60.0) -> None:
    """Send `body` to the router (round robin, ideally) until every pod has served a request."""
    deadline = time.monotonic() + timeout
    while not all(requests_served(pod.metrics_url) > 0 for pod in cluster.pods):
        assert time.monotonic() < deadline, "the router did not route to every pod"
        response = httpx.post(cluster.base_url + "/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
