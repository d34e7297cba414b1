"""Faults on the KV path (decode pod -> prefill pod's `PullKV`) through a loopback TCP proxy.

The decode pod is told to pull from the proxy, which delays, black-holes and resets its
connections, then heals. Every request must end before its deadline with the clean run's greedy
tokens (pulled, or prefilled locally after a lost pull) or a clean gRPC error; once healed, the
tokens equal the clean run's and pulls go through the proxy again; nothing stays held.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tests.faults.cluster import PROXY_PORT, wait_idle
from tests.faults.tcp_proxy import FaultProxy
from tests.pods.podproc import pod_channel, sampling, vouched
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

PROMPTS = [[1] + [(13 * i + k) % 250 + 4 for i in range(n)] for k, n in ((0, 40), (3, 90), (7, 17))]
PARAMS = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
CLEAN_ERRORS = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


async def _request(prefill, decode, rid: str, prompt: list[int], pull_from: str, timeout: float):
    """Prefill on P directly and Generate on D pulling from `pull_from`. Returns
    (tokens, local_prefill, None) or (None, None, status code), and the seconds it took."""
    started = time.monotonic()
    params = sampling(**PARAMS)
    async with pod_channel(prefill.address) as pc, pod_channel(decode.address) as dc:
        pre = pb_grpc.PrefillServiceStub(pc).Prefill(
            pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=params), timeout=timeout)
        gen = pb_grpc.DecodeServiceStub(dc).Generate(
            vouched(pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=params, prefill_from=pull_from)),
            timeout=timeout)
        try:
            messages = [m async for m in gen]
            result = ([t for m in messages for t in m.token_ids], messages[0].local_prefill, None)
        except grpc.aio.AioRpcError as e:
            result = (None, None, e.code())
        pre.cancel()
        await asyncio.gather(pre, return_exceptions=True)
    return result, time.monotonic() - started


def _round(prefill, decode, tag: str, pull_from: str, timeout: float) -> list:
    async def all_at_once():
        return await asyncio.gather(*(_request(prefill, decode, f"{tag}-{i}", p, pull_from, timeout)
                                      for i, p in enumerate(PROMPTS)))
    return asyncio.run(all_at_once())


def _check(results, clean: list[list[int]], timeout: float, allow_errors: bool) -> list[bool]:
    """Every request ended in time with the clean tokens (or, if allowed, a clean error); returns
    local_prefill per request that produced tokens."""
    local = []
    for (tokens, local_prefill, code), seconds in results:
        assert seconds < timeout + 15, seconds
        if tokens is None:
            assert allow_errors and code in CLEAN_ERRORS, code
            continue
        assert tokens in clean, (tokens, clean)
        local.append(local_prefill)
    return local


def test_kv_path_delays_drops_and_resets_then_heals(idle_pair):
    prefill, decode = idle_pair
    clean_results = _round(prefill, decode, "clean", prefill.address, 60)
    assert all(code is None and not local for (_, local, code), _ in clean_results), clean_results
    clean = [tokens for (tokens, _, _), _ in clean_results]

    with FaultProxy("127.0.0.1", prefill.port, port=PROXY_PORT) as proxy:   # the pair advertises it
        # Through a healthy proxy: pulled, not prefilled locally.
        assert _check(_round(prefill, decode, "pass", proxy.address, 60), clean, 60, False) == [False] * 3

        proxy.set_mode("delay", delay_s=0.3)
        _check(_round(prefill, decode, "delay", proxy.address, 60), clean, 60, False)

        proxy.set_mode("reset")   # each pull's connection is reset: D prefills locally
        assert all(_check(_round(prefill, decode, "reset", proxy.address, 60), clean, 60, True))

        proxy.set_mode("drop")    # a partition: only the request deadline ends the wait
        _check(_round(prefill, decode, "drop", proxy.address, 10), clean, 10, True)

        proxy.heal()
        deadline = time.monotonic() + 90
        attempt = 0
        while True:   # correct tokens at once; pulls through the proxy once D has reconnected
            local = _check(_round(prefill, decode, f"healed-{attempt}", proxy.address, 60), clean, 60, False)
            if local == [False] * 3:
                break
            assert time.monotonic() < deadline, "the decode pod never pulled through the healed proxy again"
            attempt += 1
            time.sleep(1.0)
        assert proxy.num_resets > 0
    wait_idle([prefill, decode])
