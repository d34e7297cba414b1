"""Case 3 of issue 11 with real pods on loopback: pods answer only their cluster.

An outside client gets nothing from a pod without the deployment secret; with it, a decode pod
still dials only a prefill address the router vouched for (no SSRF), and a prefill pod hands out
KV only against the router's handle for that request and its own address. The positive controls
(the same calls with a valid handle) prove each refusal is the check, not a broken setup.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.handles import CLOCK_SKEW_SECONDS, KVHandles
from pod.auth import SECRET_ENV, auth_metadata
from router.pod_session import DecodeSession
from tests.pods.podproc import HANDLES, Pod, disaggregated, pod_channel, run, sampling, vouched
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
PROMPT = [1] + list(range(20, 60))


@pytest.fixture(scope="module")
def pods():
    prefill = Pod("prefill")
    decode = Pod("decode")
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        decode.stop()
        prefill.stop()


def _code(coro_or_error) -> grpc.StatusCode:
    return coro_or_error.value.code()


def test_no_secret_no_service(pods):
    prefill, decode = pods

    async def scenario():
        for secret in (None, "not-the-cluster-secret"):
            metadata = auth_metadata(secret) if secret else None
            async with grpc.aio.insecure_channel(decode.address) as dc, \
                    grpc.aio.insecure_channel(prefill.address) as pc:
                gen = pb_grpc.DecodeServiceStub(dc).Generate(pb.GenerateRequest(
                    request_id="outsider", prompt_token_ids=PROMPT, sampling=sampling(max_tokens=4)),
                    timeout=20, metadata=metadata)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    [m async for m in gen]
                assert _code(refused) == grpc.StatusCode.UNAUTHENTICATED and "cluster secret" in refused.value.details()
                ps = pb_grpc.PrefillServiceStub(pc)
                calls = [ps.Prefill(pb.PrefillRequest(request_id="outsider", prompt_token_ids=PROMPT,
                                                      sampling=sampling(max_tokens=1)), timeout=20, metadata=metadata),
                         ps.GetLoad(pb.LoadRequest(), timeout=20, metadata=metadata),
                         ps.Abort(pb.AbortRequest(request_id="x"), timeout=20, metadata=metadata),
                         pb_grpc.DecodeServiceStub(dc).Handshake(pb.HandshakeRequest(), timeout=20, metadata=metadata)]
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call
                    assert _code(refused) == grpc.StatusCode.UNAUTHENTICATED
                pull = ps.PullKV(pb.PullKVRequest(request_id="outsider"), timeout=20, metadata=metadata)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    [c async for c in pull]
                assert _code(refused) == grpc.StatusCode.UNAUTHENTICATED
                # Health stays open to the kubelet's probes.
                reply = await health_pb2_grpc.HealthStub(dc).Check(health_pb2.HealthCheckRequest(), timeout=20)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    run(scenario())
    # Nothing was queued, computed or held for the outsider.
    assert prefill.load().num_held_kv == 0 and decode.load().num_running == 0


def test_pull_kv_needs_the_routers_handle(pods):
    prefill, _ = pods
    idle = prefill.load().num_free_blocks
    now = time.time()
    forged = KVHandles.from_secret("an-attacker-made-this-up").issue("held", prefill.address, now + 60)
    refused_handles = {
        "none": None,
        "forged": forged,
        "other request": HANDLES.issue("another", prefill.address, now + 60),
        "other address": HANDLES.issue("held", "127.0.0.1:1", now + 60),
        "expired": HANDLES.issue("held", prefill.address, now - CLOCK_SKEW_SECONDS - 5),
    }

    async def scenario():
        async with pod_channel(prefill.address) as pc:
            stub = pb_grpc.PrefillServiceStub(pc)
            model = (await stub.Handshake(pb.HandshakeRequest(), timeout=20)).model
            await stub.Prefill(pb.PrefillRequest(request_id="held", prompt_token_ids=PROMPT,
                                                 sampling=sampling(max_tokens=4, temperature=0.0)), timeout=60)
            for name, handle in refused_handles.items():
                request = pb.PullKVRequest(request_id="held", model=model, transport="grpc")
                if handle is not None:
                    request.kv_handle.CopyFrom(handle)
                chunks = []
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for chunk in stub.PullKV(request, timeout=20):
                        chunks.append(chunk)
                assert _code(refused) == grpc.StatusCode.PERMISSION_DENIED, name
                assert chunks == [], f"{name}: KV bytes left the pod"
            # The same pull with the router's handle gets the KV: the refusals were the handle check.
            request = pb.PullKVRequest(request_id="held", model=model, transport="grpc",
                                       kv_handle=HANDLES.issue("held", prefill.address, time.time() + 60))
            chunks = [chunk async for chunk in stub.PullKV(request, timeout=60)]
            return chunks

    chunks = run(scenario())
    assert chunks[-1].last and sum(len(c.data) for c in chunks) > 0
    prefill.wait_free_blocks(idle, timeout=60)   # the pull's end released the blocks


class _Listener:
    """A loopback socket that records whether anything connected to it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.setblocking(False)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def connected(self, within: float) -> bool:
        deadline = time.monotonic() + within
        while True:
            try:
                conn, _ = self.sock.accept()
                conn.close()
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)

    def close(self) -> None:
        self.sock.close()


def test_generate_dials_only_a_vouched_prefill_address(pods):
    _, decode = pods
    idle = decode.load().num_free_blocks
    target = _Listener()
    now = time.time()
    refused_handles = {
        "none": None,
        "forged": KVHandles.from_secret("an-attacker-made-this-up").issue("ssrf", target.address, now + 60),
        "vouched for another address": HANDLES.issue("ssrf", "127.0.0.1:1", now + 60),
        "vouched for another request": HANDLES.issue("other", target.address, now + 60),
        "expired": HANDLES.issue("ssrf", target.address, now - CLOCK_SKEW_SECONDS - 5),
    }

    after_ids = itertools.count()

    async def on_session(handle):
        """The same request on a Session (how the router sends it): refused alone, session intact."""
        request = pb.GenerateRequest(request_id="ssrf-session", prompt_token_ids=PROMPT,
                                     sampling=sampling(max_tokens=4), prefill_from=target.address)
        if handle is not None:
            request.kv_handle.CopyFrom(handle)
        async with pod_channel(decode.address) as dc:
            session = DecodeSession(pb_grpc.DecodeServiceStub(dc), decode.address, inactivity_seconds=30)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await session.generate(request, timeout=60).read()
                # A fresh id each time: the previous one may still be finishing on the pod (it
                # was read only up to its first token), and a reused id is refused as in use.
                ok = session.generate(pb.GenerateRequest(request_id=f"local-after-{next(after_ids)}",
                                                         prompt_token_ids=PROMPT,
                                                         sampling=sampling(max_tokens=2)), timeout=60)
                assert (await ok.read()).token_ids
                return refused.value
            finally:
                session.close()

    async def attempt(handle, request_id="ssrf", until_connected=False):
        request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                     sampling=sampling(max_tokens=4), prefill_from=target.address)
        if handle is not None:
            request.kv_handle.CopyFrom(handle)
        async with pod_channel(decode.address) as dc:
            gen = pb_grpc.DecodeServiceStub(dc).Generate(request, timeout=60)
            if until_connected:   # the positive control: wait for the dial, then hang up
                connected = await asyncio.to_thread(target.connected, 60)
                gen.cancel()
                return connected
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [m async for m in gen]
            return refused.value

    try:
        for name, handle in refused_handles.items():
            error = run(attempt(handle))
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (name, error)
            assert "handle" in error.details(), name
            error = run(on_session(handle))
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "handle" in error.details(), name
        assert not target.connected(within=1.0), "the decode pod dialled an address nobody vouched for"
        # Positive control: with the router's handle the decode pod does dial that address.
        assert run(attempt(HANDLES.issue("vouched", target.address, time.time() + 60), "vouched",
                           until_connected=True))
    finally:
        target.close()
    decode.wait_free_blocks(idle, timeout=60)


def test_with_the_secret_and_a_handle_disaggregation_works(pods):
    prefill, decode = pods
    tokens, messages = run(disaggregated(prefill, decode, "trusted", PROMPT, sampling(max_tokens=6, temperature=0.0)))
    assert len(tokens) == 6 and not messages[0].local_prefill and messages[0].kv_transfer_seconds > 0


def test_a_pod_without_a_secret_refuses_to_start():
    pod = Pod("decode", env={SECRET_ENV: ""})
    try:
        assert pod.proc.wait(120) == 2
        assert "--insecure-no-cluster-secret" in pod.log_tail()
    finally:
        pod.stop()


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (a decode pod's engine core is its child)."""
    pids = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                pids += _process_tree(int(child))
    return pids


def _listening(pid: int) -> list[str]:
    """Local addresses ("IP:port", IPv4 and IPv6 hex as /proc shows them) of the listening TCP
    sockets of `pid` and its descendants."""
    inodes = set()
    for proc in _process_tree(pid):
        for fd in os.listdir(f"/proc/{proc}/fd"):
            try:
                target = os.readlink(f"/proc/{proc}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:   # 0A = LISTEN
                found.append(fields[1])
    return found


def _ipv4_loopback(hex_address: str) -> bool:
    host = hex_address.split(":")[0]
    return host == "0100007F" or host == "0000000000000000FFFF00000100007F"   # 127.0.0.1 (v4, v4-mapped)


def test_rendezvous_and_collective_listen_only_on_the_pods_host():
    """`--kv-transport nccl` (Gloo on CPU) with `--host 127.0.0.1`: the TCPStore and the process
    group bind loopback, like the gRPC and metrics servers; nothing listens on other interfaces."""
    prefill = Pod("prefill", "--kv-transport", "nccl", "--host", "127.0.0.1")
    decode = Pod("decode", "--kv-transport", "nccl", "--host", "127.0.0.1")
    try:
        prefill.wait_ready(), decode.wait_ready()
        tokens, messages = run(disaggregated(prefill, decode, "nccl-bind", PROMPT,
                                             sampling(max_tokens=4, temperature=0.0), transport="nccl"))
        assert not messages[0].local_prefill   # the pair was set up and carried the KV
        for pod in (prefill, decode):
            addresses = _listening(pod.proc.pid)
            assert len(addresses) >= 2, addresses   # gRPC + metrics at least; the decode pod also its store
            assert all(_ipv4_loopback(a) for a in addresses), (pod.role, addresses)
        assert len(_listening(decode.proc.pid)) >= 3   # the store is one of them
    finally:
        decode.kill(signal.SIGKILL)
        prefill.kill(signal.SIGKILL)
        decode.stop(), prefill.stop()


def test_mutual_tls_between_router_decode_and_prefill_pods(tmp_path):
    """Pods given certificates serve mutual TLS only; the decode pod pulls from the prefill pod
    over TLS with the same certificate; a plaintext client gets nothing; probes use the health port."""
    from tests.pods.test_auth import make_certs
    from pod.security import ClusterSecurity
    from tests.pods.podproc import SECRET

    certs = make_certs(tmp_path)
    tls = ["--tls-cert", certs["tls.crt"], "--tls-key", certs["tls.key"], "--tls-ca", certs["ca.crt"],
           "--tls-server-name", "cbserve-pods"]
    prefill = Pod("prefill", *tls, health_port=True)
    decode = Pod("decode", *tls, health_port=True)
    router = ClusterSecurity(secret=SECRET, tls_cert=certs["tls.crt"], tls_key=certs["tls.key"],
                             tls_ca=certs["ca.crt"], tls_server_name="cbserve-pods")
    try:
        prefill.wait_ready(), decode.wait_ready()

        async def plaintext():
            async with pod_channel(decode.address) as dc:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await pb_grpc.DecodeServiceStub(dc).GetLoad(pb.LoadRequest(), timeout=10)
                return refused.value.code()

        assert run(plaintext()) == grpc.StatusCode.UNAVAILABLE
        tokens, messages = run(disaggregated(prefill, decode, "tls", PROMPT, sampling(max_tokens=4, temperature=0.0),
                                             channel=lambda address: router.channel(address)))
        assert len(tokens) == 4 and not messages[0].local_prefill   # decode -> prefill over TLS
    finally:
        decode.stop(), prefill.stop()
