"""Random and oversized frames to every pod gRPC method: each call ends with a status (random
bytes that happen to parse may be answered), nothing crashes, and the pods still serve.

The frames go through a raw channel with identity serializers, so the pod receives exactly the
bytes sent, as an attacker or a broken client would send them.
"""

from __future__ import annotations

import random
import time

import grpc
import pytest

from kvtransfer.grpc_options import MAX_MESSAGE_BYTES
from tests.faults.cluster import wait_idle
from tests.pods.podproc import AUTH, disaggregated, run, sampling
from wire import cbserve_pb2

pytestmark = pytest.mark.slow

FRAMES_PER_METHOD = 20
CALL_TIMEOUT = 5.0    # a frame that parses as a valid request may wait (PullKV, WatchLoad): bounded
HEALTH = ("grpc.health.v1.Health", (("Check", "unary_unary"), ("Watch", "unary_stream")))


def _methods(service: str) -> list[tuple[str, str]]:
    desc = cbserve_pb2.DESCRIPTOR.services_by_name[service]
    kinds = {(False, False): "unary_unary", (False, True): "unary_stream", (True, True): "stream_stream",
             (True, False): "stream_unary"}
    return [(f"/{desc.full_name}/{m.name}", kinds[m.client_streaming, m.server_streaming]) for m in desc.methods]


def _call(channel: grpc.Channel, path: str, kind: str, data: bytes, timeout: float) -> grpc.StatusCode:
    """Send `data` as the serialized request (the only message of a request stream); the call's
    final status."""
    try:
        call = getattr(channel, kind)(path)
        request = iter([data]) if kind.startswith("stream") else data
        if kind.endswith("stream"):
            for _ in call(request, timeout=timeout, metadata=AUTH):   # past the secret, to the parser
                pass
        else:
            call(request, timeout=timeout, metadata=AUTH)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_random_and_oversized_frames_get_a_status_and_the_pod_still_serves(idle_pair, role):
    prefill, decode = idle_pair
    pod = prefill if role == "prefill" else decode
    methods = _methods("PrefillService" if role == "prefill" else "DecodeService")
    methods += [(f"/{HEALTH[0]}/{name}", kind) for name, kind in HEALTH[1]]
    rng = random.Random(11)
    outcomes: dict[str, dict[str, int]] = {}
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(pod.address, options=options) as channel:
        for path, kind in methods:
            seen = outcomes.setdefault(path, {})
            frames = [rng.randbytes(rng.randrange(1, 512)) for _ in range(FRAMES_PER_METHOD)]
            frames += [b"\xff" * 64, b"\x0a\xff\xff\xff\xff\x0f"]   # bad varint, truncated length
            for data in frames:
                started = time.monotonic()
                code = _call(channel, path, kind, data, CALL_TIMEOUT)
                assert time.monotonic() - started < CALL_TIMEOUT + 10, (path, code)
                seen[code.name] = seen.get(code.name, 0) + 1
            # One message past the pod's receive limit: refused before it is parsed.
            code = _call(channel, path, kind, bytes(MAX_MESSAGE_BYTES + 1024), 60.0)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (path, code)
            assert pod.proc.poll() is None, f"{role} pod died on {path}:\n{pod.log_tail()}"
    # Undecodable bytes are refused: most random frames do not parse.
    for path, seen in outcomes.items():
        assert sum(n for code, n in seen.items() if code != "OK") >= FRAMES_PER_METHOD // 2, (path, seen)
    # Still serving: a real request through both pods, then back to the idle baseline.
    tokens, messages = run(disaggregated(prefill, decode, f"after-frames-{role}", [1, 7, 9, 11, 13],
                                         sampling(temperature=0.0, max_tokens=4)))
    assert len(tokens) == 4 and messages[-1].finished
    wait_idle([prefill, decode])
