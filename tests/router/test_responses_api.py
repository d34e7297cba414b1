"""`POST /v1/responses` through the official `openai` client, against fake pods: text and message
input, instructions, max_output_tokens, the typed stream events with sequence numbers, logprobs,
`text.format` reaching the pods as a StructuredSpec, and the clear 400s of a stateless server
(tools: test_responses_tools.py)."""

from __future__ import annotations

import json

import openai
import pytest

from engine.grammar.spec import StructuredSpec, canonical_json
from engine.sampling.params import from_proto
from fake_pods import Script, expected_tokens
from router_harness import running_router

pytestmark = pytest.mark.anyio


def _prompt(tokenizer, messages) -> list[int]:
    return tokenizer.encode_chat(messages)


async def test_text_input_whole_response(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script()]) as h:
        response = await h.openai().responses.create(model="fake-model", input="Say hi", max_output_tokens=5,
                                                     temperature=0, instructions="Be brief.")
        prompt = _prompt(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}])
        text = tokenizer.decode(expected_tokens(prompt, 5))
        assert response.output_text == text
        assert response.object == "response" and response.id.startswith("resp_")
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.input_tokens == len(prompt) and response.usage.output_tokens == 5
        assert response.usage.total_tokens == len(prompt) + 5
        (item,) = response.output
        assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
        assert response.instructions == "Be brief." and response.max_output_tokens == 5
        sent = h.prefill[0].records.prefill_requests[0]
        assert list(sent.prompt_token_ids) == prompt
        assert from_proto(sent.sampling).max_tokens == 5


async def test_message_items_and_completed_status(tokenizer):
    async with running_router(tokenizer, colocated=[Script(eos_at=3)]) as h:
        items = [{"role": "user", "content": "first"},
                 {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                 {"role": "user", "content": [{"type": "input_text", "text": "second "},
                                              {"type": "input_text", "text": "part"}]}]
        response = await h.openai().responses.create(model="fake-model", input=items, max_output_tokens=20)
        prompt = _prompt(tokenizer, [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                                     {"role": "user", "content": "second part"}])
        assert list(h.colocated[0].records.generate_requests[0].prompt_token_ids) == prompt
        assert response.status == "completed" and response.incomplete_details is None
        assert response.output_text == tokenizer.decode(expected_tokens(prompt, 3))   # eos ends it


async def test_stream_events_in_order(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script()]) as h:
        client = h.openai()
        whole = await client.responses.create(model="fake-model", input="stream me", max_output_tokens=6)
        stream = await client.responses.create(model="fake-model", input="stream me", max_output_tokens=6,
                                               stream=True)
        events = [e async for e in stream]
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.incomplete"]
        assert set(kinds[4:-4]) == {"response.output_text.delta"}
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == whole.output_text == events[-4].text
        final = events[-1].response
        assert final.output_text == whole.output_text and final.usage.output_tokens == 6
        assert events[0].response.status == "in_progress" and events[0].response.id == final.id
        item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
        assert item_ids == {final.output[0].id}


async def test_raw_sse_framing_has_event_lines_and_no_done(tokenizer):
    async with running_router(tokenizer, colocated=[Script()]) as h:
        async with h.http().stream("POST", "/v1/responses", json={"input": "x", "max_output_tokens": 2,
                                                                   "stream": True}) as response:
            lines = [line async for line in response.aiter_lines() if line]
        assert response.headers["content-type"].startswith("text/event-stream")
        pairs = list(zip(lines[::2], lines[1::2]))
        for event_line, data_line in pairs:
            assert event_line.startswith("event: ") and data_line.startswith("data: ")
            assert json.loads(data_line[6:])["type"] == event_line[7:]
        assert "[DONE]" not in "".join(lines)


async def test_logprobs_through_include(tokenizer):
    async with running_router(tokenizer, colocated=[Script()]) as h:
        response = await h.openai().responses.create(model="fake-model", input="lp", max_output_tokens=3,
                                                     top_logprobs=1, include=["message.output_text.logprobs"])
        entries = response.output[0].content[0].logprobs
        assert len(entries) == 3 and all(len(e.top_logprobs) == 1 and e.bytes for e in entries)
        assert "".join(e.token for e in entries) == response.output_text


async def test_text_format_json_schema_reaches_the_pods(tokenizer):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    async with running_router(tokenizer, prefill=[Script()], decode=[Script()]) as h:
        await h.openai().responses.create(model="fake-model", input="json please", max_output_tokens=4,
                                          text={"format": {"type": "json_schema", "name": "reply", "schema": schema,
                                                           "strict": True}})
        for sent in (h.prefill[0].records.prefill_requests[0], h.decode[0].records.generate_requests[0]):
            assert from_proto(sent.sampling).structured == StructuredSpec("json_schema", canonical_json(schema))
        await h.openai().responses.create(model="fake-model", input="json", max_output_tokens=2,
                                          text={"format": {"type": "json_object"}})
        assert from_proto(h.decode[0].records.generate_requests[1].sampling).structured == StructuredSpec("json_object")


REFUSALS = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": 7, "output": "1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
]


async def test_what_a_stateless_server_refuses(tokenizer):
    async with running_router(tokenizer, colocated=[Script()]) as h:   # one router for every case
        for fields, param in REFUSALS:
            response = await h.http().post("/v1/responses", json={"input": "hi", **fields})
            assert response.status_code == 400, (fields, response.text)
            error = response.json()["error"]
            assert error["param"] == param and error["message"], (fields, error)
        assert h.num_pod_requests() == 0


async def test_store_false_is_fine_and_the_client_raises_bad_request(tokenizer):
    async with running_router(tokenizer, colocated=[Script()]) as h:
        client = h.openai()
        ok = await client.responses.create(model="fake-model", input="hi", store=False, max_output_tokens=2)
        assert ok.status == "incomplete"
        with pytest.raises(openai.BadRequestError, match="stateless"):
            await client.responses.create(model="fake-model", input="hi", previous_response_id=ok.id)
