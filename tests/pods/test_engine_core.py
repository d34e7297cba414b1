"""A pod's engine runs in its own process (`pod/core.py`), apart from the gRPC server.

Against real pod processes, decode and prefill: the core is the server's child and serves
requests; it never outlives the server; a dead core fails the open requests (and a prefill pod's
open KV pulls) with UNAVAILABLE and takes the pod down (so the kubelet or `cbserve up` restarts
it); SIGTERM drains the open requests (and a prefill pod's KV still waiting for its pull), then
stops the core. And in this process: the statistics the core sends become the server's load
reports and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import types
import signal
import time
from pathlib import Path

import grpc
import pytest

from pod.core import stats_to_pb
from pod.core_client import CoreRuntime, NewTokens
from decode_pod.open_request import OpenRequest
from engine.engine import EngineConfig
from engine.outputs import EngineStats, StepSample
from pod.runtime import PodConfig
from tests.pods.podproc import HANDLES, Pod, pod_channel, run, sampling
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return found


def engine_core_of(pod: Pod) -> int:
    cores = [c for c in children(pod.proc.pid)
             if "--engine-core-fd" in Path(f"/proc/{c}/cmdline").read_bytes().decode().split("\0")]
    assert len(cores) == 1, f"expected one engine-core child of {pod.proc.pid}, found {cores}"
    return cores[0]


def gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True   # exited; its parent has not reaped it yet
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def pod_and_core(*args: str, role: str = "decode"):
    """A ready pod (decode unless `role` says) and the pid of its engine core; SIGKILLed at the end."""
    pod = Pod(role, *args)
    try:
        pod.wait_ready()
        yield pod, engine_core_of(pod)
    finally:
        pod.kill()
        pod.proc.wait(15)


def request(req_id: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=req_id, prompt_token_ids=[1, 5, 9, 13, 17, 21],
                              sampling=sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


@pytest.mark.slow
def test_engine_core_is_a_child_that_never_outlives_its_server():
    with pod_and_core() as (pod, core):

        async def generate():
            async with pod_channel(pod.address) as channel:
                stub = pb_grpc.DecodeServiceStub(channel)
                return [t async for m in stub.Generate(request("child", 8), timeout=60) for t in m.token_ids]

        assert len(run(generate())) == 8
        os.kill(pod.proc.pid, signal.SIGKILL)      # the server alone, not its process group
        assert gone(core, timeout=10), "the engine core outlived its server"


@pytest.mark.slow
def test_a_prefill_pods_engine_core_is_a_child_that_never_outlives_its_server():
    with pod_and_core(role="prefill") as (pod, core):

        async def prefill():
            async with pod_channel(pod.address) as channel:
                stub = pb_grpc.PrefillServiceStub(channel)
                return await stub.Prefill(prefill_request("child"), timeout=60)

        assert run(prefill()).first_token_id > 0
        os.kill(pod.proc.pid, signal.SIGKILL)
        assert gone(core, timeout=10), "the engine core outlived its server"


def prefill_request(req_id: str) -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=req_id, prompt_token_ids=[1] + list(range(4, 100)),
                             sampling=sampling(temperature=0.0, max_tokens=8))


def pull_request(req_id: str, model: pb.ModelInfo, address: str) -> pb.PullKVRequest:
    return pb.PullKVRequest(request_id=req_id, model=model, transport="grpc",
                            kv_handle=HANDLES.issue(req_id, address, time.time() + 120))


@pytest.mark.slow
def test_sigterm_waits_for_held_kv_to_be_pulled_then_stops_the_prefill_core():
    """The held count the drain waits on comes from the core's statistics."""
    with pod_and_core("--drain-seconds", "60", "--kv-ttl-seconds", "60", role="prefill") as (pod, core):

        async def scenario():
            async with pod_channel(pod.address) as channel:
                stub = pb_grpc.PrefillServiceStub(channel)
                model = (await stub.Handshake(pb.HandshakeRequest(), timeout=20)).model
                first = await stub.Prefill(prefill_request("held"), timeout=60)
                os.kill(pod.proc.pid, signal.SIGTERM)
                await asyncio.sleep(2.0)
                assert pod.proc.poll() is None, "the pod exited with KV still waiting for its pull"
                chunks = [c async for c in stub.PullKV(pull_request("held", model, pod.address), timeout=60)]
                return first, chunks

        first, chunks = run(scenario())
        assert chunks[-1].last and chunks[-1].first_token_id == first.first_token_id
        assert sum(c.num_blocks for c in chunks) == -(-97 // 16)
        assert pod.proc.wait(30) == 0
        assert gone(core, timeout=10)


async def open_generate(channel, pod: Pod):
    """A decode pod's request in the middle of its tokens."""
    call = pb_grpc.DecodeServiceStub(channel).Generate(request("doomed", 2000), timeout=120)
    await call.read()
    return call


async def open_pull(channel, pod: Pod):
    """A prefill pod's KV pull waiting for a Prefill that has not come: open in the core."""
    stub = pb_grpc.PrefillServiceStub(channel)
    model = (await stub.Handshake(pb.HandshakeRequest(), timeout=20)).model
    call = stub.PullKV(pull_request("waiting", model, pod.address), timeout=120)
    await asyncio.sleep(1.0)
    return call


@pytest.mark.slow
@pytest.mark.parametrize("role, open_call", [("decode", open_generate), ("prefill", open_pull)])
def test_a_dead_engine_core_fails_open_calls_and_the_pod_exits(role, open_call):
    with pod_and_core(role=role) as (pod, core):

        async def scenario():
            async with pod_channel(pod.address) as channel:
                call = await open_call(channel, pod)
                os.kill(core, signal.SIGKILL)
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
                return err.value, time.monotonic() - started

        error, seconds = run(scenario())
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "engine process exited" in error.details()
        assert seconds < 10
        assert pod.proc.wait(30) != 0, "a pod whose engine died must exit (and be restarted)"


@pytest.mark.slow
def test_sigterm_drains_open_requests_then_stops_the_engine_core():
    with pod_and_core("--drain-seconds", "60") as (pod, core):

        async def scenario():
            async with pod_channel(pod.address) as channel:
                call = pb_grpc.DecodeServiceStub(channel).Generate(request("drained", 64), timeout=120)
                tokens = list((await call.read()).token_ids)
                os.kill(pod.proc.pid, signal.SIGTERM)
                async for message in call:
                    tokens += message.token_ids
                return tokens

        assert len(run(scenario())) == 64
        assert pod.proc.wait(30) == 0
        assert gone(core, timeout=10)


def test_the_cores_statistics_become_load_reports_and_metrics():
    rt = CoreRuntime(EngineConfig(model="tiny"), PodConfig(), "decode", argv=[])
    assert rt.engine is None                     # no model loaded in the server process
    ready = pb.CoreReady(block_size=16, max_num_seqs=48)
    ready.model.model_name = "tiny"
    rt.apply_ready(ready)
    assert rt.model_info.model_name == "tiny"
    stats = EngineStats(num_running=3, num_waiting=2, prefill_queue_tokens=70, num_free_blocks=50,
                        num_total_blocks=64, kv_cache_usage=0.22, prefix_cache_hit_ratio=0.5,
                        num_preemptions=1, step_seconds_ewma=0.02, prefill_tokens_per_second=900.0, num_steps=12)
    samples = [(10, StepSample(3, 120, 0, 0.02)), (11, StepSample(3, 123, 16, 0.03))]
    message = pb.CoreStats()
    stats_to_pb(stats, samples, message)
    rt.apply_stats(pb.CoreStats.FromString(message.SerializeToString()))
    assert rt.snapshot == stats
    report, last = rt.load_report(since_step=10)
    assert last == 11 and [s.num_prefill_tokens for s in report.step_samples] == [16]
    assert (report.num_running, report.num_waiting, report.num_free_blocks, report.block_size,
            report.max_num_seqs) == (3, 2, 50, 16, 48)
    assert rt.metrics.registry.get_sample_value("cbserve_requests_running", {"role": "decode"}) == 3
    assert rt.stall_threshold() >= 0.03


def test_steps_that_arrive_together_read_as_one_response():
    """The server drains everything the core sent for a request since its last message: a first
    output (a `CoreOutput`) with packed tokens after it, or packed tokens before the last output."""
    rt = CoreRuntime(EngineConfig(model="tiny"), PodConfig(), "decode", argv=[])
    rt.loop = types.SimpleNamespace(subscribe_with=lambda *a: None, unsubscribe=lambda *a: None,
                                    abort=lambda *a: None)
    servicer = types.SimpleNamespace(rt=rt, jobs={})

    async def scenario():
        req = OpenRequest(servicer, pb.GenerateRequest(request_id="r", prompt_token_ids=[1, 5, 9]), 60,
                          lambda item: None)
        first = pb.CoreOutput(request_id="r", new_token_ids=[7], num_prompt_tokens=3, num_cached_tokens=2,
                              local_prefill=True)
        response, error = req.respond([first, NewTokens([8, 9])])
        assert error is None and list(response.token_ids) == [7, 8, 9] and response.index == 0
        assert (response.num_prompt_tokens, response.num_cached_tokens, response.local_prefill) == (3, 2, True)
        last = pb.CoreOutput(request_id="r", new_token_ids=[11], finished=True, finish_reason="length",
                             num_prompt_tokens=3)
        response, error = req.respond([NewTokens([10]), last])
        assert list(response.token_ids) == [10, 11] and response.index == 3 and response.num_prompt_tokens == 3
        assert response.finished and response.finish_reason == "length" and req.finished
        req.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("seed", range(5))
def test_frames_arrive_whole_however_the_bytes_are_split(seed):
    """`FrameReader` against reads cut anywhere: small frames many to a read, a header split across
    reads, frames larger than its buffer read into their own (the server's end of the core's socket)."""
    import random

    from pod.core import FRAME, FrameReader

    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 3, 40, 200, 1000, 5000]) for _ in range(300)] + [rng.randrange(1, 3000) for _ in range(20)]
    rng.shuffle(sizes)
    frames = [bytes(rng.randrange(256) for _ in range(n)) for n in sizes]
    stream = b"".join(FRAME.pack(len(f)) + f for f in frames)
    got, closed = [], []
    reader = FrameReader(lambda data: got.append(bytes(data)), lambda: closed.append(True), buffer_bytes=1024)
    pos = 0
    while pos < len(stream):
        buf = reader.get_buffer(-1)
        n = min(len(buf), rng.randrange(1, 4000), len(stream) - pos)
        buf[:n] = stream[pos:pos + n]
        reader.buffer_updated(n)
        pos += n
    reader.connection_lost(None)
    assert got == frames and closed == [True]
