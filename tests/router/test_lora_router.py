"""The router's LoRA API over fake pods: `model` selects an adapter the pods serve (404 otherwise,
OpenAI's model_not_found), `/v1/models` lists adapters with their base as `parent`, requests reach
only pods serving the adapter and carry its name, and runtime loading fans out to every pod,
undoing a load that any pod refuses (400 / 403 with the reason), retrying pods that were down,
and answering each error with vLLM's status."""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest

from tests.router.fake_pods import Script
from tests.router.router_harness import running_router

pytestmark = pytest.mark.anyio
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def _serving(*names):
    script = Script()
    script.load.max_loras = 2
    for name in names:
        script.load.lora_adapters.add(name=name, identity=f"id-{name}", registered=True)
    return script


async def test_model_selects_an_adapter_the_pods_serve(tokenizer):
    async with running_router(tokenizer, prefill=[_serving("sql"), _serving()], decode=[_serving("sql"), _serving()],
                              enable_lora=True) as h:
        client = h.openai()
        models = await client.models.list()
        cards = {m.id: m for m in models.data}
        assert set(cards) == {"fake-model", "sql"}
        assert cards["sql"].parent == "fake-model" and cards["sql"].root == "sql"
        for _ in range(6):
            out = await client.completions.create(model="sql", prompt="hi", max_tokens=3)
            assert out.model == "sql"
        sent = [r for p in h.pods for r in (*p.records.prefill_requests, *p.records.generate_requests)]
        assert {r.lora_name for r in sent} == {"sql"}
        assert not h.prefill[1].records.num_requests and not h.decode[1].records.num_requests
        base = await client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=2)
        assert base.model == "fake-model"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.completions.create(model="nope", prompt="hi", max_tokens=3)
        assert missing.value.code == "model_not_found" and "nope" in missing.value.message


async def test_adapters_are_refused_when_the_router_has_lora_off(tokenizer):
    async with running_router(tokenizer, prefill=[_serving("sql")], decode=[_serving("sql")]) as h:
        client = h.openai()
        assert [m.id for m in (await client.models.list()).data] == ["fake-model"]
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="sql", prompt="hi", max_tokens=3)
        response = await h.http().post(LOAD, json={"lora_name": "x", "lora_path": "x"})
        assert response.status_code == 403 and "--allow-runtime-lora-updating" in response.json()["error"]["message"]


async def test_runtime_load_fans_out_and_unload_removes(tokenizer):
    async with running_router(tokenizer, prefill=[_serving()], decode=[_serving(), _serving()],
                              enable_lora=True, allow_runtime_lora_updating=True) as h:
        http = h.http()
        response = await http.post(LOAD, json={"lora_name": "extra", "lora_path": "extra"})
        assert response.status_code == 200 and response.text == "Success: LoRA adapter 'extra' added successfully."
        assert all(p.records.lora_calls == [("load", "extra")] for p in h.pods)
        # Routable at once: the router re-read the pods' reports before answering.
        out = await h.openai().completions.create(model="extra", prompt="hi", max_tokens=2)
        assert out.model == "extra"
        again = await http.post(LOAD, json={"lora_name": "extra", "lora_path": "extra"})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        response = await http.post(UNLOAD, json={"lora_name": "extra"})
        assert response.status_code == 200 and "removed successfully" in response.text
        with pytest.raises(openai.NotFoundError):
            await h.openai().completions.create(model="extra", prompt="hi", max_tokens=2)
        missing = await http.post(UNLOAD, json={"lora_name": "extra"})
        assert missing.status_code == 404 and "cannot be found" in missing.json()["error"]["message"]


@pytest.mark.parametrize("code, status", [(grpc.StatusCode.INVALID_ARGUMENT, 400),
                                          (grpc.StatusCode.PERMISSION_DENIED, 403)])
async def test_a_refusal_on_one_pod_undoes_the_load_everywhere(tokenizer, code, status):
    refusing = _serving()
    refusing.lora_refusals["bad"] = (code, "LoRA adapter rank 64 exceeds --max-lora-rank 16")
    async with running_router(tokenizer, prefill=[_serving()], decode=[_serving(), refusing],
                              enable_lora=True, allow_runtime_lora_updating=True) as h:
        response = await h.http().post(LOAD, json={"lora_name": "bad", "lora_path": "/adapters/bad"})
        assert response.status_code == status
        error = response.json()["error"]
        assert "exceeds --max-lora-rank 16" in error["message"] and error["param"] == "lora_path"
        assert all(not p.script.load.lora_adapters for p in h.pods)       # rolled back where it was taken
        assert ("unload", "bad") in h.prefill[0].records.lora_calls


async def test_request_errors(tokenizer):
    async with running_router(tokenizer, prefill=[_serving()], decode=[_serving()],
                              enable_lora=True, allow_runtime_lora_updating=True) as h:
        http = h.http()
        for body, param in [({"lora_name": "a b", "lora_path": "x"}, "lora_name"),
                            ({"lora_name": "fake-model", "lora_path": "x"}, "lora_name"),
                            ({"lora_name": "x"}, "lora_path"), ({"lora_name": "x", "lora_path": 3}, "lora_path")]:
            response = await http.post(LOAD, json=body)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, body
        assert not any(p.records.lora_calls for p in h.pods)


async def test_a_pod_that_was_down_gets_the_adapter_when_it_is_back(tokenizer):
    async with running_router(tokenizer, prefill=[_serving()], decode=[_serving(), _serving()],
                              enable_lora=True, allow_runtime_lora_updating=True) as h:
        late = h.decode[1]
        late.script.down = True
        response = await h.http().post(LOAD, json={"lora_name": "extra", "lora_path": "extra"})
        assert response.status_code == 200
        assert not late.script.load.lora_adapters
        # Loaded once through this router: a second load is 400 even while the pod that missed the
        # first is back and still lacks it (it would take it, and the answer would depend on how
        # fast the reconciler is). The reconciler waits until then.
        admin = h.app.state.lora_admin
        await admin.stop()
        late.script.down = False
        await h.wait_routable(len(h.pods))
        again = await h.http().post(LOAD, json={"lora_name": "extra", "lora_path": "extra"})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        assert not late.script.load.lora_adapters
        admin.start()
        for _ in range(200):
            if late.script.load.lora_adapters:
                break
            await asyncio.sleep(0.05)
        assert [a.name for a in late.script.load.lora_adapters] == ["extra"]
