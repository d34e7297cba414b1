"""KV handles: only the router's voucher for (request id, prefill address), unexpired, passes."""

from __future__ import annotations

import pytest

from kvtransfer.handles import CLOCK_SKEW_SECONDS, KVHandles
from wire import cbserve_pb2 as pb

SECRET = "s3cret-s3cret-s3cret-s3cret"
NOW = 1_800_000_000.0
ROUTER = KVHandles.from_secret(SECRET)
GOOD = ROUTER.issue("req-1", "10.0.0.7:50051", NOW + 60)


def _with(**changes) -> pb.KVHandle:
    handle = pb.KVHandle()
    handle.CopyFrom(GOOD)
    for name, value in changes.items():
        setattr(handle, name, value)
    return handle


CASES = [
    # (name, handle, request id, address, now, expected problem substring or None)
    ("valid", GOOD, "req-1", "10.0.0.7:50051", NOW, None),
    ("valid until its expiry", GOOD, "req-1", "10.0.0.7:50051", NOW + 60, None),
    ("clock skew tolerated", GOOD, "req-1", "10.0.0.7:50051", NOW + 60 + CLOCK_SKEW_SECONDS - 1, None),
    ("expired", GOOD, "req-1", "10.0.0.7:50051", NOW + 60 + CLOCK_SKEW_SECONDS + 5, "expired"),
    ("missing", None, "req-1", "10.0.0.7:50051", NOW, "no KV handle"),
    ("empty", pb.KVHandle(), "req-1", "10.0.0.7:50051", NOW, "no KV handle"),
    ("forged mac", _with(mac=b"\0" * 32), "req-1", "10.0.0.7:50051", NOW, "does not vouch"),
    ("truncated mac", _with(mac=GOOD.mac[:16]), "req-1", "10.0.0.7:50051", NOW, "does not vouch"),
    ("expiry extended", _with(expires_unix_ms=GOOD.expires_unix_ms + 3_600_000), "req-1", "10.0.0.7:50051",
     NOW, "does not vouch"),
    ("wrong request id", GOOD, "req-2", "10.0.0.7:50051", NOW, "does not vouch"),
    ("wrong address", GOOD, "req-1", "10.0.0.8:50051", NOW, "does not vouch"),
    ("wrong port", GOOD, "req-1", "10.0.0.7:50052", NOW, "does not vouch"),
    ("other secret", KVHandles.from_secret("another-secret-another").issue("req-1", "10.0.0.7:50051", NOW + 60),
     "req-1", "10.0.0.7:50051", NOW, "does not vouch"),
    # Length prefixes: moving the boundary between request id and address changes the MAC.
    ("fields shifted", ROUTER.issue("req-1|10.0.0.7", ":50051", NOW + 60), "req-1", "10.0.0.7:50051", NOW,
     "does not vouch"),
]


@pytest.mark.parametrize("name,handle,request_id,address,now,expected", CASES, ids=[c[0] for c in CASES])
def test_handle(name, handle, request_id, address, now, expected):
    problem = ROUTER.problem(handle, request_id, address, now=now)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and expected in problem
        assert SECRET not in problem


def test_handle_survives_the_wire():
    wire = pb.GenerateRequest(request_id="r", prefill_from="a:1", kv_handle=GOOD).SerializeToString()
    back = pb.GenerateRequest.FromString(wire)
    assert ROUTER.problem(back.kv_handle, "req-1", "10.0.0.7:50051", now=NOW) is None
    assert repr(ROUTER).count(ROUTER.key.hex()) == 0   # the key never shows in logs
