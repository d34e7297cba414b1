"""Readiness probes, as Kubernetes runs them: gRPC health on a pod, HTTP /ready on the router."""

from __future__ import annotations

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc


def grpc_serving(address: str, timeout: float = 1.0, service: str = "") -> bool:
    """True when the standard gRPC health service at HOST:PORT answers SERVING for `service`."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_ready(url: str, timeout: float = 1.0) -> bool:
    """True when GET `url` answers 200."""
    try:
        return httpx.get(url, timeout=timeout, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False
