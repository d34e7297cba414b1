"""The real `openai` client against the router over fake pods: streaming, non-streaming, usage."""

from __future__ import annotations

import pytest

from fake_pods import EOS_ID, Script, expected_tokens
from router_harness import running_router

pytestmark = pytest.mark.anyio


def _text(tokenizer, ids):
    return tokenizer.decode([i for i in ids if i != EOS_ID])


async def test_completion_non_streaming_disaggregated(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script()]) as h:
        client = h.openai()
        result = await client.completions.create(model="fake-model", prompt="hello world", max_tokens=7,
                                                 temperature=0)
        prompt_ids = tokenizer.encode("hello world")
        assert result.choices[0].text == _text(tokenizer, expected_tokens(prompt_ids, 7))
        assert result.choices[0].finish_reason == "length"
        assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt_ids), 7)
        prefill, decode = h.prefill[0].records, h.decode[0].records
        assert len(prefill.prefill_requests) == 1 and len(decode.generate_requests) == 1
        assert decode.generate_requests[0].prefill_from == h.prefill[0].address


async def test_streamed_text_equals_non_streamed(tokenizer):
    async with running_router(tokenizer, prefill=[Script(token_delay=0.002)], decode=[Script(eos_at=9)]) as h:
        client = h.openai()
        whole = await client.completions.create(model="fake-model", prompt="abc", max_tokens=20)
        stream = await client.completions.create(model="fake-model", prompt="abc", max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True})
        pieces, finish, usage = [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.text)
                finish = choice.finish_reason or finish
        assert "".join(pieces) == whole.choices[0].text
        assert finish == whole.choices[0].finish_reason == "stop"
        assert usage.completion_tokens == whole.usage.completion_tokens == 10


async def test_chat_streaming_and_non_streaming(tokenizer):
    async with running_router(tokenizer, colocated=[Script()]) as h:
        client = h.openai()
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        whole = await client.chat.completions.create(model="fake-model", messages=messages, max_tokens=5)
        prompt_ids = tokenizer.encode_chat(messages)
        assert whole.choices[0].message.content == _text(tokenizer, expected_tokens(prompt_ids, 5))
        assert whole.usage.prompt_tokens == len(prompt_ids)
        stream = await client.chat.completions.create(model="fake-model", messages=messages,
                                                      max_completion_tokens=5, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == whole.choices[0].message.content
        assert h.colocated[0].records.generate_requests[0].prefill_from == ""
