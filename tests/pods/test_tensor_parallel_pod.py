"""Tensor-parallel pods over real processes (Gloo, one rank subprocess per extra rank): P/D
between different TP degrees (P at TP=2 -> D at TP=1, the reverse, and 2 -> 2) decodes the tokens
of a TP=1 colocated engine; a killed rank takes its pod down (NOT_SERVING, exit with a message
naming the rank) within a bounded time instead of hanging; a TP pod refuses the NCCL transport."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading

import grpc
import pytest

from engine.config import CacheConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from engine.tp.launch import EXIT_RANK_LOST
from tests.pods.podproc import AUTH, Pod, disaggregated, run, sampling
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

EXIT_DEADLINE_SECONDS = 60.0   # the watchdog polls every 0.2 s; generous for a loaded machine
PROMPT = list(range(5, 105))   # 100 tokens: two prefill chunks (64-token steps), 7 blocks, the last partial
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pods():
    args = ("--num-blocks", "64")
    started = {"p1": Pod("prefill", *args), "p2": Pod("prefill", *args, "--tensor-parallel-size", "2"),
               "d1": Pod("decode", *args), "d2": Pod("decode", *args, "--tensor-parallel-size", "2")}
    try:
        for pod in started.values():
            pod.wait_ready(timeout=300)
        yield started
    finally:
        for pod in started.values():
            pod.stop()


@pytest.fixture(scope="module")
def expected() -> list[int]:
    engine = Engine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=64)))
    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return out.output_token_ids


@pytest.mark.parametrize("prefill, decode", [("p2", "d1"), ("p1", "d2"), ("p2", "d2")])
def test_pd_across_tensor_parallel_degrees_equals_colocated(pods, expected, prefill, decode):
    tokens, messages = run(disaggregated(pods[prefill], pods[decode], f"{prefill}-{decode}", PROMPT,
                                         sampling(max_tokens=MAX_TOKENS, temperature=0.0)))
    assert not any(m.local_prefill for m in messages), "the KV must come from the prefill pod"
    assert tokens == expected


def test_a_rank_killed_mid_stream_ends_its_pod_with_a_clear_error(pods):
    pod = pods["d2"]
    match = re.search(r"tensor-parallel rank 1/2 started \(pid (\d+)\)", pod.log.read_text())
    assert match, pod.log_tail()
    worker = int(match.group(1))
    streaming, ended = threading.Event(), threading.Event()
    errors: list[grpc.RpcError] = []

    def consume() -> None:   # a long colocated decode, so the rank dies in the middle of steps
        with grpc.insecure_channel(pod.address) as channel:
            stream = pb_grpc.DecodeServiceStub(channel).Generate(pb.GenerateRequest(
                request_id="long", prompt_token_ids=PROMPT, sampling=sampling(max_tokens=800, temperature=0.0)),
                timeout=EXIT_DEADLINE_SECONDS * 2, metadata=AUTH)
            try:
                for _ in stream:
                    streaming.set()
            except grpc.RpcError as e:
                errors.append(e)
            ended.set()

    threading.Thread(target=consume, daemon=True).start()
    assert streaming.wait(120), (errors, pod.log_tail())
    os.kill(worker, signal.SIGKILL)
    try:
        code = pod.proc.wait(EXIT_DEADLINE_SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pod still running {EXIT_DEADLINE_SECONDS}s after its rank died:\n{pod.log_tail()}")
    assert code == EXIT_RANK_LOST
    assert f"tensor-parallel rank 1 (pid {worker}) killed by signal 9" in pod.log.read_text()
    assert ended.wait(30), "the client's stream must end when the pod goes"


def test_tensor_parallel_pods_refuse_the_nccl_transport():
    pod = Pod("prefill", "--tensor-parallel-size", "2", "--kv-transport", "nccl")
    try:
        code = pod.proc.wait(120)
    finally:
        pod.stop()
    assert code == 2
    assert "needs --kv-transport grpc" in pod.log.read_text()
