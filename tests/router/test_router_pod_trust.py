"""The router's side of "pods trust only their cluster": it carries the deployment secret on
every pod call and vouches for the prefill pod it names (a KV handle per request)."""

from __future__ import annotations

import time

import pytest

from fake_pods import Script
from kvtransfer.handles import KVHandles
from pod.auth import ServerAuth
from pod.security import ClusterSecurity
from router_harness import running_router

pytestmark = pytest.mark.anyio
SECRET = "router-test-cluster-secret"


async def test_router_sends_the_secret_and_a_handle_for_its_prefill_pod(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script()],
                              pod_interceptors=[ServerAuth(SECRET)],
                              security=ClusterSecurity(secret=SECRET)) as h:
        client = h.openai()
        completion = await client.completions.create(model="fake-model", prompt="hello", max_tokens=4)
        assert completion.choices[0].text
        (request,) = h.decode[0].records.generate_requests
        prefill = h.prefill[0].address
        assert request.prefill_from == prefill
        handles = KVHandles.from_secret(SECRET)
        assert handles.problem(request.kv_handle, request.request_id, prefill) is None
        # It expires with the request's deadline (request_timeout_seconds, 600 s by default).
        assert time.time() < request.kv_handle.expires_unix_ms / 1000 <= time.time() + 601
        assert handles.problem(request.kv_handle, request.request_id, "127.0.0.1:1") is not None


async def test_a_router_without_the_secret_cannot_use_the_pods(tokenizer):
    with pytest.raises(AssertionError, match="routable"):
        async with running_router(tokenizer, prefill=[Script()], decode=[Script()],
                                  pod_interceptors=[ServerAuth(SECRET)]):
            pass
