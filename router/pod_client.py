"""PodClient: one gRPC channel to one pod and the calls the router makes on it.

The router talks to pods only through the generated stubs (`wire.cbserve_pb2_grpc`). Prefill
pods serve `PrefillService`; decode and colocated pods serve `DecodeService`. Both offer Handshake,
Abort, GetLoad and WatchLoad, so the load tracker and the health probe treat every pod alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvtransfer.grpc_options import channel_options
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc
from pod.security import ClusterSecurity
from router.pod_session import DecodeSession, SessionCall

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")
# Keepalive as on every cbserve channel: a frozen pod fails every call on it within ~8 s.
_CHANNEL_OPTIONS = channel_options()


class PodClient:
    """The router's handle on one pod at `address` ("host:port") with role prefill|decode|colocated."""

    def __init__(self, address: str, role: str, inactivity_seconds: float = 10.0,
                 security: ClusterSecurity = ClusterSecurity()) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.address = address
        self.role = role
        # The secret goes as per-call metadata (`metadata=self._auth` on every call), not through a
        # channel interceptor: aio interceptors wrap each streamed message (~15 us per message).
        self._channel = security.channel(address, _CHANNEL_OPTIONS, add_secret=False)
        self._auth = security.call_metadata()
        self._kv_handles = security.handles
        if role == "prefill":
            self._stub: pb_grpc.PrefillServiceStub | pb_grpc.DecodeServiceStub = pb_grpc.PrefillServiceStub(self._channel)
        else:
            self._stub = pb_grpc.DecodeServiceStub(self._channel)
        self.inactivity_seconds = inactivity_seconds
        self._session: DecodeSession | None = None
        self.health = health_pb2_grpc.HealthStub(self._channel)   # grpc.health.v1, as readiness probes read it

    async def close(self) -> None:
        if self._session is not None:
            self._session.close()
        await self._channel.close(grace=None)

    async def handshake(self, timeout: float) -> pb.HandshakeResponse:
        return await self._stub.Handshake(pb.HandshakeRequest(), timeout=timeout, metadata=self._auth)

    async def get_load(self, timeout: float) -> pb.LoadReport:
        return await self._stub.GetLoad(pb.LoadRequest(), timeout=timeout, metadata=self._auth)

    def watch_load(self, interval_seconds: float) -> AsyncIterator[pb.LoadReport]:
        """A stream of load reports every `interval_seconds`; ends or raises when the pod goes away."""
        return self._stub.WatchLoad(pb.WatchLoadRequest(interval_seconds=interval_seconds), metadata=self._auth)

    def prefill(self, request: pb.PrefillRequest, timeout: float) -> grpc.aio.UnaryUnaryCall:
        """Start Prefill; the returned call is awaitable and cancellable (cancel frees P's state)."""
        assert self.role == "prefill", f"Prefill on a {self.role} pod"
        return self._stub.Prefill(request, timeout=timeout, metadata=self._auth)

    def generate(self, request: pb.GenerateRequest, timeout: float) -> SessionCall:
        """Start a request on this pod's Session (opened on first use, reopened after it broke);
        `read()` the call for GenerateResponse messages, `cancel()` it to abort."""
        assert self.role != "prefill", "Generate on a prefill pod"
        self.vouch(request, timeout)
        session = self._session
        if session is None or session.broken:
            session = self._session = DecodeSession(self._stub, self.address, self.inactivity_seconds,
                                                    metadata=self._auth)
        return session.generate(request, timeout)

    def vouch(self, request: pb.GenerateRequest, timeout: float) -> None:
        """Sign `request.prefill_from` for this request until its deadline (`kvtransfer.handles`):
        without the handle the decode pod refuses to pull from that address."""
        if request.prefill_from and self._kv_handles is not None:
            request.kv_handle.CopyFrom(self._kv_handles.issue(
                request.request_id, request.prefill_from, time.time() + timeout))

    async def load_lora_adapter(self, name: str, path: str, timeout: float) -> pb.LoRAAdapterResponse:
        return await self._stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path),
                                                timeout=timeout, metadata=self._auth)

    async def unload_lora_adapter(self, name: str, timeout: float) -> pb.LoRAAdapterResponse:
        return await self._stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name=name), timeout=timeout,
                                                  metadata=self._auth)

    async def abort(self, request_id: str, timeout: float = 1.0) -> None:
        """Best-effort Abort: cancellation already frees the pod's state; this covers a lost cancel."""
        try:
            await self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout, metadata=self._auth)
        except grpc.aio.AioRpcError as exc:
            log.debug("abort %s on %s failed: %s", request_id, self.address, exc.code())
        except grpc.aio.UsageError:
            log.debug("abort %s on %s skipped: channel closed", request_id, self.address)

    def __repr__(self) -> str:
        return f"PodClient({self.role}@{self.address})"
