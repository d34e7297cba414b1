"""`/tokenize`, `/detokenize`, `/tokenizer_info` in vLLM's shapes, answered by the router (no pod call),
behind the same API key as /v1; chat messages go through the chat template as chat requests do."""

from __future__ import annotations

import pytest

from fake_pods import Script
from router_harness import running_router

pytestmark = pytest.mark.anyio


async def test_tokenize_prompt_and_messages(tokenizer):
    async with running_router(tokenizer, colocated=[Script(max_model_len=256)]) as h:
        http = h.http()
        body = (await http.post("/tokenize", json={"prompt": "héllo"})).json()
        ids = tokenizer.encode("héllo")
        assert body == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
        plain = (await http.post("/tokenize", json={"prompt": "héllo", "add_special_tokens": False,
                                                    "return_token_strs": True})).json()
        assert plain["tokens"] == tokenizer.encode("héllo", add_special_tokens=False) == ids[1:]
        assert plain["token_strs"] == tokenizer.convert_ids_to_tokens(ids[1:])

        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "u"}]}]
        chat = (await http.post("/tokenize", json={"messages": messages})).json()
        flat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        assert chat["tokens"] == tokenizer.encode_chat(flat) and chat["count"] == len(chat["tokens"])
        bare = (await http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})).json()
        assert bare["tokens"] == tokenizer.encode_chat(flat, add_generation_prompt=False)
        # Tokenize what a chat request would send: the same ids reach the pod.
        await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert list(h.colocated[0].records.generate_requests[0].prompt_token_ids) == chat["tokens"]

        cont = (await http.post("/tokenize", json={
            "messages": [*flat, {"role": "assistant", "content": "The answer is"}],
            "add_generation_prompt": False, "continue_final_message": True})).json()
        text = tokenizer.decode(cont["tokens"], skip_special_tokens=False)
        assert text.endswith("The answer is")
        assert h.num_pod_requests() == 1, "tokenize never asks a pod"


async def test_detokenize_round_trip(tokenizer):
    async with running_router(tokenizer, colocated=[Script()]) as h:
        http = h.http()
        ids = tokenizer.encode("round trip ✓")
        assert (await http.post("/detokenize", json={"tokens": ids})).json() == {
            "prompt": tokenizer.decode(ids, skip_special_tokens=False)}
        bad = await http.post("/detokenize", json={"tokens": [1, 10 ** 6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


REFUSALS = [
    ({}, "prompt"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"messages": [{"role": "user", "content": "b"}], "continue_final_message": True}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "b"}], "chat_template": "{{ 1 }}"}, "chat_template"),
    ({"prompt": "a", "model": "other"}, None),
]


async def test_tokenize_refusals(tokenizer):
    async with running_router(tokenizer, colocated=[Script()]) as h:   # one router for every case
        for body, param in REFUSALS:
            response = await h.http().post("/tokenize", json=body)
            assert response.status_code == (404 if "model" in body else 400), (body, response.text)
            assert response.json()["error"]["param"] == param, body


async def test_same_api_key_as_v1_and_tokenizer_info_behind_its_flag(tokenizer):
    async with running_router(tokenizer, colocated=[Script()], api_key="sekret") as h:
        http = h.http()
        assert (await http.post("/tokenize", json={"prompt": "a"})).status_code == 401
        assert (await http.post("/detokenize", json={"tokens": [5]})).status_code == 401
        headers = {"Authorization": "Bearer sekret"}
        assert (await http.post("/tokenize", json={"prompt": "a"}, headers=headers)).status_code == 200
        assert (await http.get("/tokenizer_info", headers=headers)).status_code == 404   # off by default
    async with running_router(tokenizer, colocated=[Script()], enable_tokenizer_info_endpoint=True) as h:
        info = (await h.http().get("/tokenizer_info")).json()
        assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
        assert info["chat_template"] == tokenizer.chat_template
