"""OpenAI and vLLM request fields end to end: n, stop, seed, logprobs, echo, usage, extra sampling fields."""

from __future__ import annotations

import json

import pytest

from engine.sampling.params import from_proto
from fake_pods import Script, expected_tokens
from router_harness import running_router

pytestmark = pytest.mark.anyio


async def test_extra_sampling_fields_reach_the_pods(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script()]) as h:
        body = {"prompt": "abc", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
                "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": 1234,
                "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [7, 8], "stop": ["zz"]}
        response = await h.http().post("/v1/completions", json=body)
        assert response.status_code == 200
        for sent in (h.prefill[0].records.prefill_requests[0], h.decode[0].records.generate_requests[0]):
            params = from_proto(sent.sampling)
            assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 0.9, 40, 0.05)
            assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.1, 0.5, -0.5)
            assert (params.seed, params.ignore_eos, params.min_tokens, params.max_tokens) == (1234, True, 2, 5)
            assert params.stop_token_ids == (7, 8) and params.stop == ("zz",)
        prefill_req, generate_req = h.prefill[0].records.prefill_requests[0], h.decode[0].records.generate_requests[0]
        assert prefill_req.request_id == generate_req.request_id
        assert list(prefill_req.prompt_token_ids) == tokenizer.encode("abc")


async def test_n_choices_and_batch_prompts(tokenizer):
    async with running_router(tokenizer, colocated=[Script()]) as h:
        result = await h.openai().completions.create(model="fake-model", prompt=["ab", "cd"], n=2, max_tokens=3,
                                                      seed=7)
        assert [c.index for c in result.choices] == [0, 1, 2, 3]
        for choice, prompt in zip(result.choices, ["ab", "ab", "cd", "cd"]):
            assert choice.text == tokenizer.decode(expected_tokens(tokenizer.encode(prompt), 3))
        assert result.usage.prompt_tokens == len(tokenizer.encode("ab")) + len(tokenizer.encode("cd"))
        assert result.usage.completion_tokens == 12
        seeds = sorted(from_proto(r.sampling).seed for r in h.colocated[0].records.generate_requests)
        assert seeds == [7, 7, 8, 8]        # choice j of each prompt gets seed + j


async def test_stop_string_cuts_text_and_cancels_the_pod(tokenizer):
    prompt = tokenizer.encode("abc")
    full = tokenizer.decode(expected_tokens(prompt, 30))
    stop = full[5:7]
    cut = full[: full.index(stop)]
    async with running_router(tokenizer, prefill=[Script()], decode=[Script(token_delay=0.01)]) as h:
        client = h.openai()
        whole = await client.completions.create(model="fake-model", prompt="abc", max_tokens=30, stop=[stop])
        assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
        stream = await client.completions.create(model="fake-model", prompt="abc", max_tokens=30, stop=stop,
                                                 stream=True)
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks) == cut
        assert chunks[-1].choices[0].finish_reason == "stop"


async def test_completion_logprobs_and_echo(tokenizer):
    async with running_router(tokenizer, prefill=[Script(logprob=-0.25)], decode=[Script(logprob=-0.25)]) as h:
        result = await h.openai().completions.create(model="fake-model", prompt="abc", max_tokens=4, logprobs=1)
        logprobs = result.choices[0].logprobs
        assert logprobs.token_logprobs == [-0.25] * 4
        assert "".join(logprobs.tokens) == result.choices[0].text
        assert logprobs.text_offset == [0, 1, 2, 3]
        assert all(len(top) == 1 for top in logprobs.top_logprobs)
        echoed = await h.openai().completions.create(model="fake-model", prompt="abc", max_tokens=4, echo=True)
        assert echoed.choices[0].text == "abc" + result.choices[0].text


async def test_chat_logprobs_usage_chunk_and_sse_framing(tokenizer):
    async with running_router(tokenizer, colocated=[Script()]) as h:
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}],
                "max_tokens": 3, "logprobs": True, "top_logprobs": 1, "stream": True,
                "stream_options": {"include_usage": True}}
        async with h.http().stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            raw = [line async for line in response.aiter_lines() if line]
        assert all(line.startswith("data: ") for line in raw) and raw[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in raw[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert all(c["usage"] is None for c in chunks[:-1])
        content = [c["choices"][0] for c in chunks[1:-1]]
        assert content[-1]["finish_reason"] == "length"
        entries = [e for c in content if c["logprobs"] for e in c["logprobs"]["content"]]
        assert len(entries) == 3 and all(e["top_logprobs"][0]["logprob"] == e["logprob"] for e in entries)
        prompt = tokenizer.encode_chat([{"role": "user", "content": "hi there"}])
        assert list(h.colocated[0].records.generate_requests[0].prompt_token_ids) == prompt


async def test_chat_max_tokens_default_and_precedence(tokenizer):
    async with running_router(tokenizer, colocated=[Script(eos_at=2)]) as h:
        messages = [{"role": "user", "content": "hi"}]
        await h.http().post("/v1/chat/completions", json={"messages": messages})
        await h.http().post("/v1/chat/completions", json={"messages": messages, "max_tokens": 50,
                                                          "max_completion_tokens": 9})
        first, second = (from_proto(r.sampling).max_tokens for r in h.colocated[0].records.generate_requests)
        assert first == 256 - len(tokenizer.encode_chat(messages))   # what fits in the context
        assert second == 9
