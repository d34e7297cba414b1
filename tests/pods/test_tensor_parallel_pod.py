"""A tensor-parallel pod (TP=2 over Gloo, one rank subprocess) serves over gRPC the tokens a TP=1
engine computes; a killed rank takes the pod down (NOT_SERVING, exit with a message naming the
rank) within a bounded time instead of hanging; P/D roles refuse TP > 1 until transfers map ranks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import grpc
import pytest

from engine.config import CacheConfig
from engine.engine import Engine, EngineConfig
from engine.sampling_params import SamplingParams
from engine.tp_launch import EXIT_RANK_LOST
from tests.pods.podproc import Pod, run, sampling
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

EXIT_DEADLINE_SECONDS = 60.0   # watchdog polls every 0.2 s; generous for a loaded machine


@pytest.fixture
def tp_pod():
    pod = Pod("decode", "--colocated", "--tensor-parallel-size", "2", "--num-blocks", "64")
    try:
        yield pod.wait_ready(timeout=240)
    finally:
        pod.stop()


async def _generate(address: str, prompt: list[int], max_tokens: int) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stream = pb_grpc.DecodeServiceStub(channel).Generate(
            pb.GenerateRequest(request_id="tp", prompt_token_ids=prompt,
                               sampling=sampling(max_tokens=max_tokens, temperature=0.0)), timeout=120)
        return [t async for m in stream for t in m.token_ids]


def test_tp_pod_serves_tp1_tokens_then_a_killed_rank_ends_it(tp_pod):
    prompt = list(range(5, 45))
    tokens = run(_generate(tp_pod.address, prompt, 8))
    engine = Engine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=64)))
    (expected,) = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))
    assert tokens == expected.output_token_ids

    match = re.search(r"tensor-parallel rank 1/2 started \(pid (\d+)\)", tp_pod.log.read_text())
    assert match, tp_pod.log_tail()
    worker = int(match.group(1))
    os.kill(worker, signal.SIGKILL)
    try:
        code = tp_pod.proc.wait(EXIT_DEADLINE_SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pod still running {EXIT_DEADLINE_SECONDS}s after its rank died:\n{tp_pod.log_tail()}")
    assert code == EXIT_RANK_LOST
    assert f"tensor-parallel rank 1 (pid {worker}) killed by signal 9" in tp_pod.log.read_text()


def test_pd_roles_refuse_tensor_parallel_clearly():
    pod = Pod("prefill", "--tensor-parallel-size", "2")
    try:
        code = pod.proc.wait(120)
    finally:
        pod.stop()
    assert code == 2
    assert "runs only in a colocated pod" in pod.log.read_text()
