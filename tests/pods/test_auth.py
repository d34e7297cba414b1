"""The deployment secret and TLS on a real gRPC server on loopback (pod/auth.py, pod/security.py)."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pod.auth import SECRET_ENV, SecretError, auth_metadata, client_auth, read_cluster_secret
from pod.security import ClusterSecurity, add_security_flags, advertise_address, security_from_args
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

SECRET = "test-cluster-secret-0123456789"


class _Decode(pb_grpc.DecodeServiceServicer):
    async def GetLoad(self, request, context):
        return pb.LoadReport(pod_id="here")

    async def Generate(self, request, context):
        for i in range(3):
            yield pb.GenerateResponse(request_id=request.request_id, index=i, token_ids=[i])


async def _serve(security: ClusterSecurity):
    server = grpc.aio.server(interceptors=security.server_interceptors())
    pb_grpc.add_DecodeServiceServicer_to_server(_Decode(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = security.add_port(server, "127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _calls(channel, metadata=None):
    """GetLoad and a Generate stream on `channel`: the pod id, or the status code of the failure."""
    stub = pb_grpc.DecodeServiceStub(channel)
    try:
        report = await stub.GetLoad(pb.LoadRequest(), timeout=10, metadata=metadata)
        tokens = [m.token_ids[0] async for m in stub.Generate(pb.GenerateRequest(request_id="r"), timeout=10,
                                                               metadata=metadata)]
        assert tokens == [0, 1, 2]
        return report.pod_id
    except grpc.aio.AioRpcError as e:
        return e.code()


def test_secret_required_on_every_rpc_but_health():
    async def body():
        server, address = await _serve(ClusterSecurity(secret=SECRET))
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                assert await _calls(ch) == grpc.StatusCode.UNAUTHENTICATED
                assert await _calls(ch, auth_metadata("wrong-secret-wrong-secret")) == grpc.StatusCode.UNAUTHENTICATED
                assert await _calls(ch, (("authorization", SECRET),)) == grpc.StatusCode.UNAUTHENTICATED  # no Bearer
                assert await _calls(ch, auth_metadata(SECRET)) == "here"
                try:
                    await pb_grpc.DecodeServiceStub(ch).GetLoad(pb.LoadRequest(), timeout=10)
                except grpc.aio.AioRpcError as e:
                    assert "cluster secret" in e.details()
                # Health stays open: the kubelet's probes carry no metadata.
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            async with grpc.aio.insecure_channel(address, interceptors=client_auth(SECRET)) as ch:
                assert await _calls(ch) == "here"
            async with ClusterSecurity(secret=SECRET).channel(address) as ch:
                assert await _calls(ch) == "here"
        finally:
            await server.stop(None)
    asyncio.run(body())


def test_secret_sources(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert read_cluster_secret(str(path), environ={}) == SECRET
    assert read_cluster_secret(None, environ={SECRET_ENV: SECRET}) == SECRET
    assert read_cluster_secret(None, environ={}) is None
    with pytest.raises(SecretError, match="shorter"):
        read_cluster_secret(None, environ={SECRET_ENV: "short"})
    with pytest.raises(SecretError, match="cannot read"):
        read_cluster_secret(str(tmp_path / "missing"), environ={})

    parser = argparse.ArgumentParser()
    add_security_flags(parser, pod=True)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="--insecure-no-cluster-secret"):
        security_from_args(parser.parse_args([]))
    assert security_from_args(parser.parse_args(["--insecure-no-cluster-secret"])).secret is None
    security = security_from_args(parser.parse_args(["--cluster-secret-file", str(path)]))
    assert security.secret == SECRET and SECRET not in repr(security)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert security_from_args(parser.parse_args([])).secret == SECRET


def test_advertise_address():
    assert advertise_address("127.0.0.1", 5, environ={}) == "127.0.0.1:5"
    assert advertise_address("0.0.0.0", 5, environ={}) == ""
    assert advertise_address("0.0.0.0", 5, environ={"CBSERVE_POD_IP": "10.1.2.3"}) == "10.1.2.3:5"
    assert advertise_address("::", 5, environ={"CBSERVE_POD_IP": "fd00::7"}) == "[fd00::7]:5"


# ------------------------------------------------------------------------------------------ TLS
def make_certs(directory: Path) -> dict[str, str]:
    """A CA and one certificate it signs for 127.0.0.1 and the name `cbserve-pods` (openssl CLI)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=cbserve-test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=cbserve-pods", "-keyout", "tls.key", "-out", "tls.csr")
    (directory / "san.ext").write_text("subjectAltName=DNS:cbserve-pods,IP:127.0.0.1\n"
                                       "extendedKeyUsage=serverAuth,clientAuth\n")
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
        "-extfile", "san.ext", "-out", "tls.crt")
    return {name: str(directory / name) for name in ("ca.crt", "tls.crt", "tls.key")}


def test_tls_refuses_plaintext_and_serves_tls(tmp_path):
    certs = make_certs(tmp_path)
    pod = ClusterSecurity(secret=SECRET, tls_cert=certs["tls.crt"], tls_key=certs["tls.key"])

    async def body():
        server, address = await _serve(pod)
        try:
            async with grpc.aio.insecure_channel(address, interceptors=client_auth(SECRET)) as ch:
                assert await _calls(ch) == grpc.StatusCode.UNAVAILABLE     # plaintext: no handshake
            router = ClusterSecurity(secret=SECRET, tls_ca=certs["ca.crt"])
            async with router.channel(address) as ch:
                assert await _calls(ch) == "here"                          # verified as 127.0.0.1
            named = ClusterSecurity(secret=SECRET, tls_ca=certs["ca.crt"], tls_server_name="cbserve-pods")
            async with named.channel(address) as ch:
                assert await _calls(ch) == "here"                          # verified by name
            async with ClusterSecurity(tls_ca=certs["ca.crt"]).channel(address) as ch:
                assert await _calls(ch) == grpc.StatusCode.UNAUTHENTICATED  # TLS is not the secret
            wrong = ClusterSecurity(secret=SECRET, tls_ca=certs["ca.crt"], tls_server_name="someone-else")
            async with wrong.channel(address) as ch:
                assert await _calls(ch) == grpc.StatusCode.UNAVAILABLE     # name mismatch
        finally:
            await server.stop(None)
    asyncio.run(body())


def test_mutual_tls_requires_a_client_certificate(tmp_path):
    certs = make_certs(tmp_path)
    pod = ClusterSecurity(secret=SECRET, tls_cert=certs["tls.crt"], tls_key=certs["tls.key"], tls_ca=certs["ca.crt"])

    async def body():
        server, address = await _serve(pod)
        try:
            async with ClusterSecurity(secret=SECRET, tls_ca=certs["ca.crt"]).channel(address) as ch:
                assert await _calls(ch) == grpc.StatusCode.UNAVAILABLE     # no client certificate
            async with pod.channel(address) as ch:                         # a peer pod: same cert
                assert await _calls(ch) == "here"
        finally:
            await server.stop(None)
    asyncio.run(body())
