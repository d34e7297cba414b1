"""Kubernetes discovery against a loopback server that speaks EndpointSlice list/watch."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes import client

from fake_kube_api import FakeKubeAPI, endpoint
from fake_pods import Script, start_pods
from router.discovery.base import PodEndpoint
from router.discovery.kubernetes import KubernetesDiscovery
from router_harness import Harness, serve_app
from router.app import create_app
from router.config import RouterConfig

pytestmark = pytest.mark.anyio
SERVICES = {"prefill": "cbserve-prefill", "decode": "cbserve-decode"}


def _api_client(api: FakeKubeAPI) -> client.ApiClient:
    return client.ApiClient(client.Configuration(host=api.host))


async def _until(predicate, timeout: float = 5.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout)


@pytest.fixture
def kube_api():
    api = FakeKubeAPI().start()
    yield api
    api.stop()


async def test_lists_then_watches_only_ready_endpoints(kube_api):
    kube_api.put_slice("cbserve-prefill", "prefill-abc", 50051, [
        endpoint("10.0.0.1", "prefill-0"),
        endpoint("10.0.0.2", "prefill-1", ready=False),                   # starting: not routed
        endpoint("10.0.0.3", "prefill-2", ready=True, terminating=True),  # going away: not routed
        endpoint("10.0.0.4", "prefill-3", ready=None)])                   # unknown reads as ready
    kube_api.put_slice("cbserve-decode", "decode-abc", 50052, [endpoint("10.0.1.1", "decode-0")])
    kube_api.put_slice("other-service", "other", 1, [endpoint("10.9.9.9", "other-0")])
    discovery = KubernetesDiscovery("serving", SERVICES, "grpc", api_client=_api_client(kube_api))
    seen = []
    discovery.subscribe(seen.append)
    await discovery.start()
    try:
        assert discovery.endpoints() == {
            PodEndpoint("10.0.0.1:50051", "prefill", "prefill-0"), PodEndpoint("10.0.0.4:50051", "prefill", "prefill-3"),
            PodEndpoint("10.0.1.1:50052", "decode", "decode-0")}
        # A pod becomes ready, another scales in: the watch carries both.
        kube_api.put_slice("cbserve-prefill", "prefill-abc", 50051, [
            endpoint("10.0.0.2", "prefill-1"), endpoint("10.0.0.4", "prefill-3")])
        await _until(lambda: {e.address for e in discovery.endpoints() if e.role == "prefill"}
                     == {"10.0.0.2:50051", "10.0.0.4:50051"})
        kube_api.put_slice("cbserve-decode", "decode-def", 50052, [endpoint("10.0.1.2", "decode-1")])
        await _until(lambda: PodEndpoint("10.0.1.2:50052", "decode", "decode-1") in discovery.endpoints())
        kube_api.delete_slice("decode-abc")                                  # deletion removes its pods
        await _until(lambda: {e.address for e in discovery.endpoints() if e.role == "decode"} == {"10.0.1.2:50052"})
        assert any("watch=true" in r for r in kube_api.requests)
        assert all(e.role in SERVICES for e in seen[-1])
    finally:
        await discovery.stop()


async def test_relists_after_410_gone(kube_api):
    kube_api.put_slice("cbserve-decode", "d1", 50052, [endpoint("10.0.1.1", "decode-0")])
    discovery = KubernetesDiscovery("serving", {"decode": "cbserve-decode"}, "grpc", api_client=_api_client(kube_api))
    await discovery.start()
    try:
        await _until(lambda: len(kube_api.requests) >= 2)        # the list, then the watch
        kube_api.expire_history()
        kube_api.put_slice("cbserve-decode", "d1", 50052, [endpoint("10.0.1.7", "decode-7")])
        await _until(lambda: {e.address for e in discovery.endpoints()} == {"10.0.1.7:50052"})
        lists = [r for r in kube_api.requests if "watch=true" not in r]
        assert len(lists) >= 2                                     # recovered by listing again
    finally:
        await discovery.stop()


async def test_router_routes_to_discovered_pods_and_drops_deleted_ones(kube_api, tokenizer):
    prefill = await start_pods("prefill", [Script()])
    decode = await start_pods("decode", [Script()])
    p_port, d_port = (int(p[0].address.rsplit(":", 1)[1]) for p in (prefill, decode))
    kube_api.put_slice("cbserve-prefill", "p", p_port, [endpoint("127.0.0.1", "prefill-0"),
                                                        endpoint("127.0.0.9", "prefill-9", ready=False)])
    kube_api.put_slice("cbserve-decode", "d", d_port, [endpoint("127.0.0.1", "decode-0")])
    config = RouterConfig(model="fake-model", discovery="kubernetes", namespace="serving", api_key_env=None,
                          prefill_service="cbserve-prefill", decode_service="cbserve-decode", max_queue_seconds=0.3)
    discovery = KubernetesDiscovery("serving", SERVICES, "grpc", api_client=_api_client(kube_api))
    app = create_app(config, tokenizer=tokenizer, discovery=discovery, default_max_model_len=256)
    try:
        async with serve_app(app) as url:
            h = Harness(url, app, prefill, decode)
            await h.wait_routable(2)
            http = h.http()
            assert (await http.get("/ready")).status_code == 200
            response = await http.post("/v1/completions", json={"prompt": "k8s", "max_tokens": 3})
            assert response.status_code == 200
            assert len(prefill[0].records.prefill_requests) == 1 and len(decode[0].records.generate_requests) == 1
            assert set(h.state.dispatcher.tracker.pods) == {prefill[0].address, decode[0].address}
            kube_api.delete_slice("d")
            await _until(lambda: decode[0].address not in h.state.dispatcher.tracker.pods)
            assert (await http.get("/ready")).status_code == 503
            response = await http.post("/v1/completions", json={"prompt": "k8s", "max_tokens": 3})
            assert response.status_code in (429, 503)
            await http.aclose()
    finally:
        for pod in (*prefill, *decode):
            await pod.stop()
