"""Logprobs as clients read them, against fake pods: echo with logprobs and `max_tokens: 0` (what
evaluation harnesses send), vLLM's `prompt_logprobs`, alternatives that never collapse, `bytes`,
and `return_tokens_as_token_ids`. (The scores themselves are checked against transformers in
tests/engine/test_prompt_logprobs.py and through real pods in tests/pods/test_prompt_logprobs_pods.py.)"""

from __future__ import annotations

import json

import pytest

from engine.sampling.params import from_proto
from fake_pods import Script, expected_tokens, fake_prompt_logprobs
from router_harness import running_router

pytestmark = pytest.mark.anyio
PROMPT = "scores!"
TOPOLOGIES = {"pd": dict(prefill=[Script()], decode=[Script()]), "colocated": dict(colocated=[Script()])}


def _expected_echo(tokenizer, num_top: int):
    ids = tokenizer.encode(PROMPT)
    scores = fake_prompt_logprobs(ids, num_top)
    return ids, scores


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
async def test_echo_with_max_tokens_0_scores_the_prompt(tokenizer, topology):
    async with running_router(tokenizer, **TOPOLOGIES[topology]) as h:
        result = await h.openai().completions.create(model="fake-model", prompt=PROMPT, max_tokens=0, echo=True,
                                                      logprobs=1, temperature=0)
        choice = result.choices[0]
        assert choice.text == PROMPT and choice.finish_reason == "length"
        assert result.usage.completion_tokens == 0 and result.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
        ids, scores = _expected_echo(tokenizer, 1)
        lp = choice.logprobs
        assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(list(scores.token_logprobs))
        for token_id, top, alt_id in zip(ids[1:], lp.top_logprobs[1:], scores.top_token_ids):
            # the one alternative asked for, and the prompt token itself when it is not that one
            expected = {tokenizer.decode([alt_id], skip_special_tokens=False)}
            if alt_id != token_id:
                expected.add(tokenizer.decode([token_id], skip_special_tokens=False))
            assert set(top) == expected
        assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
        sent = (h.prefill or h.colocated)[0].records
        params = from_proto((sent.prefill_requests or sent.generate_requests)[0].sampling)
        assert params.max_tokens == 1 and params.prompt_logprobs == 1 and params.logprobs == 1


async def test_echo_logprobs_then_the_completion_and_as_a_stream(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script()]) as h:
        client = h.openai()
        whole = await client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=3, echo=True,
                                                 logprobs=2)
        ids = tokenizer.encode(PROMPT)
        generated = expected_tokens(ids, 3)
        lp = whole.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + 3 and whole.choices[0].text == PROMPT + tokenizer.decode(generated)
        assert lp.token_logprobs[len(ids):] == [-0.5] * 3
        assert whole.usage.completion_tokens == 3

        stream = await client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=3, echo=True,
                                                  logprobs=2, stream=True)
        chunks = [c async for c in stream]
        echo = chunks[0].choices[0]
        assert echo.text == PROMPT and echo.logprobs.tokens == lp.tokens[:len(ids)]
        assert echo.logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        streamed = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
        assert streamed == lp.tokens


async def test_vllm_prompt_logprobs_on_completions_and_chat(tokenizer):
    async with running_router(tokenizer, colocated=[Script()]) as h:
        http = h.http()
        response = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        ids, scores = _expected_echo(tokenizer, 2)
        plp = choice["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        for i, (token_id, entry) in enumerate(zip(ids[1:], plp[1:])):
            mine = entry[str(token_id)]
            assert mine["logprob"] == pytest.approx(scores.token_logprobs[i])
            assert mine["rank"] == scores.token_ranks[i]
            assert mine["decoded_token"] == tokenizer.decode([token_id], skip_special_tokens=False)
            alternatives = scores.top_token_ids[2 * i:2 * i + 2]
            assert set(entry) == {str(token_id), *map(str, alternatives)}
        assert choice["logprobs"] is None and choice["text"] == tokenizer.decode(expected_tokens(ids, 2))

        messages = [{"role": "user", "content": "hi"}]
        response = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                                 "prompt_logprobs": 0})
        body = response.json()
        chat_ids = tokenizer.encode_chat(messages)
        assert len(body["prompt_logprobs"]) == len(chat_ids) and body["prompt_logprobs"][0] is None
        assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])   # the token alone

        for path, extra in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": messages})):
            refused = await http.post(path, json={**extra, "prompt_logprobs": 1, "stream": True})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
        refused = await http.post("/v1/completions", json={"prompt": PROMPT, "prompt_logprobs": 21})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


async def test_max_tokens_0_without_echo_is_refused(tokenizer):
    async with running_router(tokenizer, colocated=[Script()]) as h:
        response = await h.http().post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
        assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
        assert h.num_pod_requests() == 0


# Byte tokens 0xE2 and 0xE3 each decode to U+FFFD alone: their texts collide.
COLLIDING = (4 + 0xE2, 4 + 0xE3, 4 + ord("a"))


async def test_alternatives_with_equal_text_stay_distinct(tokenizer):
    assert len({tokenizer.decode([t]) for t in COLLIDING[:2]}) == 1
    async with running_router(tokenizer, colocated=[Script(top_alternatives=COLLIDING)]) as h:
        client = h.openai()
        result = await client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=2, logprobs=3)
        sampled = expected_tokens(tokenizer.encode(PROMPT), 2)
        for token_id, top in zip(sampled, result.choices[0].logprobs.top_logprobs):
            # three alternatives asked, three distinct keys, plus the sampled token when not among them
            assert len(top) == 3 + (token_id not in COLLIDING)
            assert "\ufffd" in top and f"token_id:{COLLIDING[1]}" in top and "a" in top
        chat = await client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=2, logprobs=True, top_logprobs=3)
        for entry in chat.choices[0].logprobs.content:
            assert [alt.bytes for alt in entry.top_logprobs] == [[0xE2], [0xE3], [ord("a")]]
            assert len(entry.top_logprobs) == 3
        as_ids = await h.http().post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "logprobs": 3,
                                                              "return_tokens_as_token_ids": True})
        lp = as_ids.json()["choices"][0]["logprobs"]
        assert all(t.startswith("token_id:") for t in lp["tokens"])
        assert set(lp["top_logprobs"][0]) >= {f"token_id:{t}" for t in COLLIDING}
        chat_ids = await h.http().post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 3,
            "return_tokens_as_token_ids": True})
        entry = chat_ids.json()["choices"][0]["logprobs"]["content"][0]
        assert [alt["token"] for alt in entry["top_logprobs"]] == [f"token_id:{t}" for t in COLLIDING]


async def test_stream_framing_of_an_echo_only_request(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script()]) as h:
        body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        async with h.http().stream("POST", "/v1/completions", json=body) as response:
            raw = [line async for line in response.aiter_lines() if line]
        chunks = [json.loads(line[6:]) for line in raw[:-1]]
        assert raw[-1] == "data: [DONE]"
        texts = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert texts == PROMPT
        assert chunks[-1]["usage"]["completion_tokens"] == 0
        finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finals[-1] == "length"
