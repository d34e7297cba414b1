"""KV handles: the router's signed voucher that one request may move KV from one prefill pod.

The router routes; pods must not take routing orders from anyone else. A `Generate` naming
`prefill_from` makes the decode pod open a connection to that address, and `PullKV` hands out a
request's raw KV, so both need proof that the router chose this pair for this request:

    handle = HMAC-SHA256(key, request_id, prefill_address, expires_unix_ms)

`key` is derived from the deployment secret (`handle_key`), so every holder of the secret can
issue and check handles, and nobody else can. The decode pod checks the handle against the
`prefill_from` it was given before it dials anything (no SSRF: an unvouched address is never
contacted); the prefill pod checks the forwarded handle against the request id and *its own
advertised address* (`--advertise-address`, the address the router reaches it at), so a handle
for one pod opens nothing on another. Expiry is the request's deadline: a handle outlives its
request by at most `CLOCK_SKEW_SECONDS`, the slack allowed between the router's and a pod's clocks.

Fields are length-prefixed before hashing, so no two (request id, address) pairs share an input.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass, field

from wire import cbserve_pb2

CLOCK_SKEW_SECONDS = 30.0        # router and pod clocks (NTP) never differ by more than this
_KEY_LABEL = b"cbserve kv handle v1"


def handle_key(cluster_secret: str) -> bytes:
    """The handle key: the deployment secret under a label of its own (so a handle's MAC is never
    a value that means something elsewhere, e.g. the secret compared by the pods' auth)."""
    return hmac.new(cluster_secret.encode(), _KEY_LABEL, hashlib.sha256).digest()


def _mac(key: bytes, request_id: str, prefill_address: str, expires_unix_ms: int) -> bytes:
    rid, addr = request_id.encode(), prefill_address.encode()
    message = b"%d:%s|%d:%s|%d" % (len(rid), rid, len(addr), addr, expires_unix_ms)
    return hmac.new(key, message, hashlib.sha256).digest()


@dataclass(frozen=True)
class KVHandles:
    """Issues and checks handles under one key (the router issues; pods check)."""

    key: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, cluster_secret: str) -> KVHandles:
        return cls(handle_key(cluster_secret))

    def issue(self, request_id: str, prefill_address: str, expires_at: float) -> cbserve_pb2.KVHandle:
        """A handle for `request_id` on the prefill pod at `prefill_address`, valid until
        `expires_at` (unix seconds; the request's deadline)."""
        expires_ms = int(expires_at * 1000)
        return cbserve_pb2.KVHandle(expires_unix_ms=expires_ms,
                                    mac=_mac(self.key, request_id, prefill_address, expires_ms))

    def problem(self, handle: cbserve_pb2.KVHandle | None, request_id: str, prefill_address: str,
                now: float | None = None) -> str | None:
        """Why `handle` does not vouch for (request_id, prefill_address) now, or None if it does.
        The message names no secret material and is safe to return to the caller."""
        if handle is None or not handle.mac:
            return "no KV handle: only the router may name a prefill pod for a request"
        expected = _mac(self.key, request_id, prefill_address, handle.expires_unix_ms)
        if not hmac.compare_digest(expected, handle.mac):
            return (f"KV handle does not vouch for request {request_id!r} at prefill pod "
                    f"{prefill_address!r} (forged, or issued for another request or address)")
        now = time.time() if now is None else now
        late = now - handle.expires_unix_ms / 1000
        if late > CLOCK_SKEW_SECONDS:
            return f"KV handle for request {request_id!r} expired {late:.0f}s ago"
        return None
