"""The official `openai` client against a real local cluster (router + prefill + decode, tiny model)."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import httpx
import openai
import pytest

from cbserve.cluster_spec import ClusterSpec
from cbserve.local_cluster import LocalCluster
from pod.auth import auth_metadata
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow
GREEDY = dict(temperature=0.0, max_tokens=24, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def cluster():
    spec = ClusterSpec(model="tiny", port=0, threads_per_pod=1, drain_seconds=5, startup_timeout=240)
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=60)


def _free_blocks(cluster) -> dict[str, int]:
    out = {}
    for pod in cluster.pods:
        with grpc.insecure_channel(pod.address) as ch:
            stub = (pb_grpc.PrefillServiceStub if pod.role == "prefill" else pb_grpc.DecodeServiceStub)(ch)
            report = stub.GetLoad(pb.LoadRequest(), timeout=5, metadata=auth_metadata(cluster.cluster_secret))
            out[pod.name] = (report.num_free_blocks, report.num_held_kv, report.num_running + report.num_waiting)
    return out


def _requests_seen(cluster) -> float:
    total = 0.0
    for pod in cluster.pods:
        page = httpx.get(pod.metrics_url, timeout=5).text
        total += sum(float(v) for v in re.findall(r"^cbserve_requests_total\{[^}]*\} (\S+)$", page, re.M))
    return total


def test_completion_stream_equals_non_stream(client):
    whole = client.completions.create(model="tiny", prompt="The quick brown fox", **GREEDY)
    parts = client.completions.create(model="tiny", prompt="The quick brown fox", stream=True, **GREEDY)
    text = "".join(chunk.choices[0].text for chunk in parts)
    assert text == whole.choices[0].text
    assert whole.usage.completion_tokens == 24 and whole.choices[0].finish_reason == "length"


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    parts = client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY)
    chunks = list(parts)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 24


def test_disaggregated_text_equals_the_colocated_engine(client):
    prompt = "Disaggregation must not change a single token. " * 6   # several prefill chunks
    via_cluster = client.completions.create(model="tiny", prompt=prompt, **GREEDY).choices[0].text
    engine = Engine(EngineConfig(model="tiny"))
    (local,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert via_cluster == local.text


def test_seeded_sampling_is_reproducible_and_n_works(client):
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0.9, top_p=0.95,
                  seed=7, extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert a.choices[0].text == b.choices[0].text
    two = client.completions.create(n=2, **kwargs)
    assert len(two.choices) == 2 and {c.index for c in two.choices} == {0, 1}


def test_client_disconnect_frees_every_pod(cluster):
    before = _free_blocks(cluster)

    async def disconnect():
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream("POST", cluster.base_url + "/completions", json={
                    "model": "tiny", "prompt": "x" * 300, "max_tokens": 400, "stream": True,
                    "ignore_eos": True}) as response:
                lines = 0
                async for line in response.aiter_lines():
                    lines += bool(line.strip())
                    if lines >= 5:
                        break   # leaving the block closes the connection mid-stream

    asyncio.run(disconnect())
    deadline = time.monotonic() + 5
    while _free_blocks(cluster) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _free_blocks(cluster) == before


@pytest.mark.parametrize("body, status", [
    ({"model": "tiny", "prompt": "hi", "max_tokens": "many"}, 400),
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, 400),
    ({"model": "tiny", "prompt": "hi", "top_p": 1.5}, 400),
    ({"model": "tiny", "prompt": "x" * 5000, "max_tokens": 16}, 400),
    ({"model": "tiny", "messages": []}, 400),
    ({"model": "nope", "prompt": "hi"}, 404),
])
def test_bad_input_is_refused_before_any_pod(cluster, body, status):
    seen = _requests_seen(cluster)
    path = "/chat/completions" if "messages" in body else "/completions"
    response = httpx.post(cluster.base_url + path, json=body, timeout=10)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and "code" in error and "param" in error
    assert _requests_seen(cluster) == seen


def test_invalid_json_is_a_400(cluster):
    response = httpx.post(cluster.base_url + "/completions", content=b"{not json",
                          headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 400 and response.json()["error"]["type"]


def test_pods_answer_only_their_cluster(cluster):
    """Case 3 of issue 11 under `cbserve up`: the pods refuse a client without the run's secret."""
    decode = next(pod for pod in cluster.pods if pod.role == "decode")
    with grpc.insecure_channel(decode.address) as ch:
        request = pb.GenerateRequest(request_id="outsider", prompt_token_ids=[1, 2, 3],
                                     sampling=pb.SamplingParams(max_tokens=2, repetition_penalty=1.0))
        with pytest.raises(grpc.RpcError) as refused:
            list(pb_grpc.DecodeServiceStub(ch).Generate(request, timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
