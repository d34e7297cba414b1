"""A pod that fails stops counting in the predictions: what its failures cost is charged to no
pod's calibration, and a pod back in routing after being out starts its history afresh (issue 20).
Real router, fake pods."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from fake_pods import Script
from router_harness import running_router

pytestmark = pytest.mark.anyio
BODY = {"prompt": "hello there", "max_tokens": 4}


async def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_request_whose_prefill_pod_failed_calibrates_no_pod(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script()], probe_interval_seconds=30) as h:
        pods = h.state.dispatcher.tracker.pods
        prefill, decode = pods[h.prefill[0].address], pods[h.decode[0].address]
        client = h.http()
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert prefill.ttft_calibration.num_samples == 1          # a clean request measures P
        h.prefill[0].script.fail_prefill = grpc.StatusCode.UNAVAILABLE
        response = await client.post("/v1/completions", json=BODY)
        assert response.status_code == 200, response.text       # D went on without P's token
        assert not prefill.routable
        # Its first token came late, and from D: neither P (the culprit) nor D is charged.
        assert prefill.ttft_calibration.num_samples == 1
        assert decode.ttft_calibration.num_samples == 0 and decode.tpot_calibration.num_samples == 0


async def test_a_pod_back_in_routing_forgets_what_was_learnt_before(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script()], probe_interval_seconds=0.2) as h:
        decode = h.state.dispatcher.tracker.pods[h.decode[0].address]
        for _ in range(decode.tpot_calibration.min_samples):
            decode.tpot_calibration.observe(3.0, 1.0)              # say, requests that hung on it
        for seqs in range(1, 20):
            decode.step_model.add(seqs, 100, 0, 10.0)              # a frozen step
        assert decode.tpot_calibration.factor == 3.0
        h.decode[0].script.down = True                             # it crashes (or freezes) ...
        await _until(lambda: not decode.routable)
        h.decode[0].script.down = False                            # ... and comes back
        await _until(lambda: decode.routable)
        assert decode.tpot_calibration.factor == 1.0 and decode.tpot_calibration.num_samples == 0
        assert decode.step_model.num_samples == 0
        assert (await h.http().post("/v1/completions", json=BODY)).status_code == 200
