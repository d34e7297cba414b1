"""The deployment secret: every pod RPC but health must carry it.

Pods answer only their cluster: the router and other pods send `authorization: Bearer <secret>`
as gRPC metadata on every call (`client_auth`, channel interceptors, so a new RPC is covered
without touching its call site), and a pod's server refuses any other call with UNAUTHENTICATED
before the request is even parsed (`ServerAuth`). `grpc.health.v1` stays open: the kubelet's gRPC
probes cannot send metadata, and health reveals nothing but SERVING/NOT_SERVING.

The comparison hashes both sides and compares the digests with `hmac.compare_digest`: constant
time, and independent of the secret's length. Without TLS the secret crosses the pod network in
the clear (like any bearer token): give the chart certificates (`docs/architecture.md`) where the
pod network is not trusted.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import grpc

METADATA_KEY = "authorization"
SECRET_ENV = "CBSERVE_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


class SecretError(ValueError):
    """The deployment secret is missing, unreadable or too weak."""


def read_cluster_secret(path: str | None = None, environ=os.environ) -> str | None:
    """The deployment secret from `path` (surrounding whitespace ignored: files written by `echo`
    and Kubernetes Secrets end in a newline), else from $CBSERVE_CLUSTER_SECRET, else None."""
    if path:
        try:
            secret = Path(path).read_text().strip()
        except OSError as e:
            raise SecretError(f"cannot read --cluster-secret-file {path}: {e.strerror}") from None
        source = f"--cluster-secret-file {path}"
    else:
        secret = environ.get(SECRET_ENV, "").strip()
        source = f"${SECRET_ENV}"
        if not secret:
            return None
    if len(secret) < MIN_SECRET_CHARS:
        raise SecretError(f"the cluster secret from {source} is shorter than {MIN_SECRET_CHARS} characters")
    return secret


def auth_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """Per-call metadata carrying `secret` (for callers without `ClientAuth` on their channel)."""
    return ((METADATA_KEY, f"Bearer {secret}"),)


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


class ServerAuth(grpc.aio.ServerInterceptor):
    """Refuses every call without the secret (UNAUTHENTICATED), except `OPEN_PREFIXES`."""

    def __init__(self, secret: str) -> None:
        self._expected = _digest(f"Bearer {secret}")

    def authorized(self, metadata) -> bool:
        given = next((v for k, v in metadata or () if k == METADATA_KEY), None)
        if not isinstance(given, str):
            return False
        return hmac.compare_digest(_digest(given), self._expected)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES) \
                or self.authorized(handler_call_details.invocation_metadata):
            return handler   # the real handler, unwrapped: no cost per message
        return _refusal(handler, handler_call_details.method)


def _refusal(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that aborts; no deserializer, so the body is never parsed."""
    message = (f"{method} needs the cluster secret ({METADATA_KEY}: Bearer <secret> metadata); "
               "pods answer only their router and peer pods")

    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class _AddSecret:
    def __init__(self, secret: str) -> None:
        self._metadata = auth_metadata(secret)

    def _with_secret(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()), *self._metadata)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


class _UnaryUnary(_AddSecret, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_secret(client_call_details), request)


class _UnaryStream(_AddSecret, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_secret(client_call_details), request)


class _StreamUnary(_AddSecret, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_secret(client_call_details), request_iterator)


class _StreamStream(_AddSecret, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_secret(client_call_details), request_iterator)


def client_auth(secret: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add the secret to every call on a channel
    (`grpc.aio.insecure_channel(address, interceptors=client_auth(secret))`). One object per call
    shape: grpc.aio files an interceptor under the first shape it implements only."""
    return [cls(secret) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
