"""Multi-LoRA end to end: the `openai` client against a real local cluster (router + prefill +
decode pods, tiny model) serving adapters. Each adapter's text equals the colocated engine with
that adapter; `/v1/models` lists the adapters with their base; runtime loading reaches both pools
and its errors have their statuses; loading and unloading while requests stream loses no request
(an unloaded adapter's admitted requests finish; new ones get 404)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from cbserve.cluster_spec import ClusterSpec
from cbserve.local_cluster import LocalCluster
from engine.config import CacheConfig
from engine.engine import Engine, EngineConfig
from engine.lora.config import LoRAConfig, LoRAModule
from engine.sampling.params import SamplingParams
from tests.pods.lora_fixtures import lora_pod_args, tiny_adapters

pytestmark = pytest.mark.slow
GREEDY = dict(temperature=0.0, max_tokens=16, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return root, tiny_adapters(root)


@pytest.fixture(scope="module")
def cluster(adapters):
    root, paths = adapters
    # SLOs a loaded 2-core machine meets: admission must not turn the traffic test's streams away.
    spec = ClusterSpec(model="tiny", port=0, threads_per_pod=1, drain_seconds=5, startup_timeout=240,
                       slo_ttft_ms=60_000, slo_tpot_ms=10_000,
                       pod_args=tuple(lora_pod_args(paths, root)),
                       router_args=("--enable-lora", "--allow-runtime-lora-updating"))
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(adapters):
    _, paths = adapters
    return Engine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=256), lora=LoRAConfig(
        max_loras=3, lora_modules=tuple(LoRAModule(n, str(p)) for n, p in paths.items()))))


def _expected(reference, prompt: str, lora: str | None) -> str:
    (out,) = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), lora=lora)
    return out.text


def _post(cluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(cluster.base_url.removesuffix("/v1") + path, json=body, timeout=120)


def test_models_list_the_adapters_with_their_base(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) >= {"tiny", "sql", "chat"}
    assert cards["sql"].parent == cards["chat"].parent == "tiny"


def test_each_adapter_equals_the_engine_with_it(client, reference):
    prompt = "SELECT the rows where the answer is " * 3
    texts = {}
    for model in ("tiny", "sql", "chat"):
        out = client.completions.create(model=model, prompt=prompt, **GREEDY)
        assert out.model == model
        texts[model] = out.choices[0].text
        assert texts[model] == _expected(reference, prompt, None if model == "tiny" else model)
    assert len(set(texts.values())) == 3, "each adapter should change the text"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-adapter", prompt=prompt, max_tokens=2)
    assert missing.value.code == "model_not_found"


def test_runtime_loading_and_its_errors(cluster, client, reference, adapters, tmp_path):
    root, paths = adapters
    assert _post(cluster, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": "extra"}).status_code == 200
    try:
        prompt = "Runtime adapters reach both pools. "
        out = client.chat.completions.create(model="extra", messages=[{"role": "user", "content": prompt}], **GREEDY)
        assert out.model == "extra" and out.choices[0].message.content
        text = client.completions.create(model="extra", prompt=prompt, **GREEDY).choices[0].text
        assert text == _expected(reference, prompt, "extra")
        again = _post(cluster, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": "extra"})
        assert again.status_code == 400
    finally:
        assert _post(cluster, "/v1/unload_lora_adapter", {"lora_name": "extra"}).status_code == 200
    outside = _post(cluster, "/v1/load_lora_adapter", {"lora_name": "escape", "lora_path": str(tmp_path)})
    assert outside.status_code == 403 and "outside --lora-root" in outside.json()["error"]["message"]
    missing = _post(cluster, "/v1/load_lora_adapter", {"lora_name": "ghost", "lora_path": "no-such-dir"})
    assert missing.status_code == 400 and "is not a directory" in missing.json()["error"]["message"]
    assert _post(cluster, "/v1/unload_lora_adapter", {"lora_name": "extra"}).status_code == 404
    assert "escape" not in {m.id for m in client.models.list().data}


def test_load_and_unload_under_traffic_lose_no_request(cluster, adapters):
    """Streams for the base model and two adapters run while a third adapter is loaded and one in
    use is unloaded: every stream that had started finishes whole; requests for the unloaded
    adapter sent afterwards get 404."""

    async def scenario():
        client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120)
        async with httpx.AsyncClient(base_url=cluster.base_url.removesuffix("/v1"), timeout=120) as http:
            assert (await http.post("/v1/load_lora_adapter",
                                    json={"lora_name": "extra", "lora_path": "extra"})).status_code == 200
            started = [asyncio.Event() for _ in range(6)]

            async def stream(i: int, model: str) -> tuple[int, str | None]:
                chunks = await client.completions.create(
                    model=model, prompt=f"Request {i} keeps going while adapters change. " * 2, stream=True,
                    stream_options={"include_usage": True}, temperature=0.0, max_tokens=40,
                    extra_body={"ignore_eos": True})
                tokens, reason = 0, None
                async for chunk in chunks:
                    started[i].set()
                    if chunk.choices:
                        reason = chunk.choices[0].finish_reason or reason
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                return tokens, reason

            models = ["tiny", "sql", "extra"] * 2
            tasks = [asyncio.create_task(stream(i, m)) for i, m in enumerate(models)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"})   # in use
            loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "chat2",
                                                                    "lora_path": "chat"})
            results = await asyncio.gather(*tasks)
            # ignore_eos: sampled without it, the random weights end a 2-token answer early now and then.
            after = await client.completions.create(model="tiny", prompt="after", max_tokens=2,
                                                    extra_body={"ignore_eos": True})
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="extra", prompt="too late", max_tokens=2)
            late = await client.completions.create(model="chat2", prompt="new", max_tokens=2,
                                                   extra_body={"ignore_eos": True})
            assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "chat2"})).status_code == 200
            await client.close()
            return unloaded.status_code, loaded.status_code, results, after, late

    unloaded, loaded, results, after, late = asyncio.run(scenario())
    assert (unloaded, loaded) == (200, 200)
    assert results == [(40, "length")] * 6
    assert after.usage.completion_tokens == 2 and late.model == "chat2"
