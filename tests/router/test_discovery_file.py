"""File discovery: the pods a JSON file lists, re-read while the router runs (pods added and
retired under `cbserve up`, or by hand)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from fake_pods import Script, start_pods
from router.discovery.base import PodEndpoint
from router.discovery.file import FileDiscovery, read_pods_file
from router_harness import running_router

pytestmark = pytest.mark.anyio


def write(path, pods: dict) -> None:
    """Atomically, as the docs ask: a temporary file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(pods))
    os.replace(tmp, path)


async def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("content,error", [
    ("not json", "is not JSON"),
    ('["127.0.0.1:1"]', "must hold an object"),
    ('{"decoder": ["127.0.0.1:1"]}', "unknown roles ['decoder']"),
    ('{"decode": "127.0.0.1:1"}', "must be a list"),
    ('{"decode": ["localhost"]}', "must be HOST:PORT"),
    ('{"decode": ["a:1"], "colocated": ["b:2"]}', "not both"),
])
def test_a_bad_pods_file_is_refused_with_a_reason(tmp_path, content, error):
    path = tmp_path / "pods.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        read_pods_file(path)


async def test_changes_are_published_and_a_bad_rewrite_keeps_the_last_good_set(tmp_path):
    path = tmp_path / "pods.json"
    write(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]})
    discovery = FileDiscovery(path, poll_seconds=0.05)
    seen = []
    discovery.subscribe(seen.append)
    await discovery.start()
    try:
        assert discovery.endpoints() == {PodEndpoint("127.0.0.1:1", "prefill", "127.0.0.1:1"),
                                         PodEndpoint("127.0.0.1:2", "decode", "127.0.0.1:2")}
        write(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2", "127.0.0.1:3"]})
        await _until(lambda: len(discovery.endpoints()) == 3)
        path.write_text("{half a fi")                     # a writer that did not rename
        await asyncio.sleep(0.3)
        assert len(discovery.endpoints()) == 3
        write(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:3"]})
        await _until(lambda: {e.address for e in discovery.endpoints()} == {"127.0.0.1:1", "127.0.0.1:3"})
        assert [len(s) for s in seen] == [0, 2, 3, 2]
    finally:
        await discovery.stop()


async def test_a_pod_added_to_the_file_is_routed_to_and_a_removed_one_is_not(tokenizer, tmp_path):
    path = tmp_path / "pods.json"
    prefill, decode_a, decode_b = (await start_pods("prefill", [Script()]) + await start_pods("decode", [Script(), Script()]))
    try:
        write(path, {"prefill": [prefill.address], "decode": [decode_a.address]})
        async with running_router(tokenizer, wait_routable=0, discovery="file", pods_file=str(path)) as h:
            tracker = h.state.dispatcher.tracker
            await _until(lambda: sum(p.routable for p in tracker.pods.values()) == 2)
            write(path, {"prefill": [prefill.address], "decode": [decode_a.address, decode_b.address]})
            await _until(lambda: decode_b.address in tracker.pods and tracker.pods[decode_b.address].routable)
            write(path, {"prefill": [prefill.address], "decode": [decode_b.address]})   # decode_a retired
            await _until(lambda: decode_a.address not in tracker.pods)
            before = len(decode_a.records.generate_requests)
            client = h.http()
            for _ in range(4):
                assert (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status_code == 200
            assert len(decode_a.records.generate_requests) == before
            assert len(decode_b.records.generate_requests) >= 4
    finally:
        for pod in (prefill, decode_a, decode_b):
            await pod.stop()
