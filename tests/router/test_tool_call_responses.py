"""Tool calls and reasoning in chat responses, read by the real `openai` client from a router over
fake pods that write fixed texts: the non-streamed message, the streamed deltas (which must
concatenate to exactly that message), the SDK's stream accumulator, and P/D equal to colocated."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from fake_pods import BYTE_OFFSET, Script
from router_harness import RouterThread

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
MESSAGES = [{"role": "user", "content": "weather in Paris and the time?"}]
HERMES_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"FR\\" é"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def ids(text: str) -> list[int]:
    return [BYTE_OFFSET + b for b in text.encode()]


@pytest.fixture(scope="module")
def routers(tokenizer):
    """Colocated and P/D routers with the hermes parser, auto tool choice and deepseek_r1 reasoning."""
    kwargs = dict(tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="deepseek_r1")
    with RouterThread(tokenizer, colocated=[Script(max_model_len=2048, tokens_per_message=3)], **kwargs) as co, \
            RouterThread(tokenizer, prefill=[Script(max_model_len=2048)], decode=[Script(max_model_len=2048)],
                         **kwargs) as pd, \
            RouterThread(tokenizer, colocated=[Script(max_model_len=2048)]) as plain:
        yield {"co": co.harness, "pd": pd.harness, "plain": plain.harness}


def script(harness, text: str, **changes) -> None:
    for pod in harness.pods:
        pod.script.output_token_ids = ids(text)
        for key, value in changes.items():
            setattr(pod.script, key, value)


def client(harness) -> openai.OpenAI:
    return openai.OpenAI(base_url=harness.url + "/v1", api_key="x", max_retries=0, timeout=30)


def streamed(harness, body: dict) -> tuple[list[dict], list[dict]]:
    """(every choice delta, every chunk) of a raw SSE stream."""
    chunks = []
    with httpx.stream("POST", harness.url + "/v1/chat/completions", timeout=30,
                      json={"model": "fake-model", "stream": True, **body}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return [c for chunk in chunks for c in chunk["choices"]], chunks


def assemble(choices: list[dict]) -> dict:
    """The message and finish reason that streamed choice deltas add up to (checking the protocol:
    one id/type/name per call index, first; fragments after)."""
    message = {"content": None, "reasoning_content": None, "tool_calls": []}
    finish = None
    for choice in choices:
        delta = choice["delta"]
        for key in ("content", "reasoning_content"):
            if delta.get(key):
                message[key] = (message[key] or "") + delta[key]
        for call in delta.get("tool_calls", []):
            calls = message["tool_calls"]
            if call["index"] == len(calls):
                assert call["id"] and call["type"] == "function" and call["function"]["name"]
                calls.append({"id": call["id"], "type": "function",
                              "function": {"name": call["function"]["name"], "arguments": ""}})
            else:
                assert call["index"] == len(calls) - 1 and "id" not in call and "name" not in call["function"]
            calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        if choice["finish_reason"] is not None:
            assert finish is None
            finish = choice["finish_reason"]
    return {**message, "finish_reason": finish}


def whole(harness, body: dict) -> dict:
    response = httpx.post(harness.url + "/v1/chat/completions", json={"model": "fake-model", **body}, timeout=30)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    message = choice["message"]
    return {"content": message["content"], "reasoning_content": message.get("reasoning_content"),
            "tool_calls": message.get("tool_calls", []), "finish_reason": choice["finish_reason"]}


def without_ids(message: dict) -> dict:
    return {**message, "tool_calls": [{**c, "id": None} for c in message["tool_calls"]]}


@pytest.mark.parametrize("layout", ["co", "pd"])
@pytest.mark.parametrize("tokens_per_message", [1, 5])
def test_tool_calls_stream_to_exactly_the_whole_message(routers, layout, tokens_per_message):
    h = routers[layout]
    script(h, HERMES_TEXT, tokens_per_message=tokens_per_message)
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 400}
    message = whole(h, body)
    # deepseek_r1 starts inside the thinking: with no </think> everything is reasoning, no call is read.
    assert message["reasoning_content"] == HERMES_TEXT and message["content"] is None
    assert message["tool_calls"] == [] and message["finish_reason"] == "stop"

    script(h, "</think>" + HERMES_TEXT, tokens_per_message=tokens_per_message)
    message = whole(h, body)
    assert message["content"] == "Let me look." and message["reasoning_content"] is None
    assert message["finish_reason"] == "tool_calls"
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": 'Paris "FR" é'}, {}]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    choices, _ = streamed(h, body)
    assert without_ids(assemble(choices)) == without_ids(message)


def test_pd_equals_colocated(routers):
    text = "<think>step one</think>\n\n" + HERMES_TEXT
    messages = []
    for layout in ("co", "pd"):
        script(routers[layout], text)
        messages.append(without_ids(whole(routers[layout], {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 400})))
    assert messages[0] == messages[1] and messages[0]["reasoning_content"] == "step one"


def test_the_sdk_accumulates_streamed_tool_calls(routers):
    h = routers["co"]
    script(h, "<think>hmm</think>" + HERMES_TEXT)
    sdk = client(h)
    with sdk.chat.completions.stream(model="fake-model", messages=MESSAGES, tools=TOOLS, max_tokens=400) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    made = sdk.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS, max_tokens=400)
    got = [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls]
    assert got == [(c.function.name, c.function.arguments) for c in made.choices[0].message.tool_calls]
    assert final.choices[0].finish_reason == made.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.content == made.choices[0].message.content == "Let me look."


def test_a_truncated_call_keeps_its_prefix_and_length(routers):
    h = routers["co"]
    text = "</think>" + HERMES_TEXT
    script(h, text)
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": len((text[:text.index('"Pa') + 3]).encode())}
    message = whole(h, body)
    assert message["finish_reason"] == "length"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["function"]["arguments"] == '{"city": "Pa'
    assert without_ids(assemble(streamed(h, body)[0])) == without_ids(message)


def test_reasoning_streams_as_reasoning_content(routers):
    h = routers["co"]
    script(h, "<think>\nfirst this, then that\n</think>\n\nThe answer is 4.")
    body = {"messages": MESSAGES, "max_tokens": 200}
    message = whole(h, body)
    assert message["reasoning_content"] == "\nfirst this, then that\n"
    assert message["content"] == "\n\nThe answer is 4." and message["finish_reason"] == "stop"
    assert assemble(streamed(h, body)[0]) == message


def test_tool_choice_none_reads_no_calls(routers):
    h = routers["co"]
    script(h, "</think>" + HERMES_TEXT)
    message = whole(h, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 400})
    assert message["content"] == HERMES_TEXT and message["tool_calls"] == [] and message["finish_reason"] == "stop"


def test_forced_calls_without_a_parser_read_the_json_list(routers):
    h = routers["plain"]
    script(h, '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]')
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 400}
    message = whole(h, body)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_time", "{}"), ("get_weather", '{"city": "Rome"}')]
    assert message["content"] is None and message["finish_reason"] == "tool_calls"
    assert "reasoning_content" not in httpx.post(h.url + "/v1/chat/completions", timeout=30, json={
        "model": "fake-model", **body}).json()["choices"][0]["message"]     # no reasoning parser: no field
    assert without_ids(assemble(streamed(h, body)[0])) == {**without_ids(message), "reasoning_content": None}


def test_legacy_functions_answer_with_function_call(routers):
    h = routers["plain"]
    script(h, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    body = {"messages": MESSAGES, "functions": [TOOLS[0]["function"]], "function_call": {"name": "get_weather"},
            "max_tokens": 200}
    response = httpx.post(h.url + "/v1/chat/completions", json={"model": "fake-model", **body}, timeout=30).json()
    choice = response["choices"][0]
    assert choice["finish_reason"] == "function_call"
    assert choice["message"]["function_call"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert "tool_calls" not in choice["message"]
    deltas, _ = streamed(h, body)
    name = "".join(d["delta"]["function_call"].get("name", "") for d in deltas if "function_call" in d["delta"])
    arguments = "".join(d["delta"]["function_call"]["arguments"] for d in deltas if "function_call" in d["delta"])
    assert (name, arguments) == ("get_weather", '{"city": "Oslo"}')
    assert deltas[-1]["finish_reason"] == "function_call"


def test_streamed_logprobs_cover_every_token_once(routers):
    h = routers["co"]
    script(h, "</think>" + HERMES_TEXT)
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 400, "logprobs": True,
            "stream_options": {"include_usage": True}}
    choices, chunks = streamed(h, body)
    tokens = sum(len(c["logprobs"]["content"]) for c in choices if c["logprobs"])
    assert tokens == chunks[-1]["usage"]["completion_tokens"]


def test_n_choices_each_get_their_calls(routers):
    h = routers["co"]
    script(h, "</think>" + HERMES_TEXT)
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 400, "n": 2}
    choices, _ = streamed(h, body)
    for index in (0, 1):
        message = assemble([c for c in choices if c["index"] == index])
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]


class Weather(BaseModel):
    city: str
    celsius: int


def test_the_sdk_parses_a_pydantic_response_format(routers):
    h = routers["plain"]
    script(h, '{"city":"Paris","celsius":21}')
    completion = client(h).chat.completions.parse(model="fake-model", messages=MESSAGES, response_format=Weather,
                                                  max_tokens=100)
    assert completion.choices[0].message.parsed == Weather(city="Paris", celsius=21)
    structured = h.colocated[0].records.generate_requests[-1].sampling.structured
    assert structured.kind == "json_schema" and json.loads(structured.text)["required"] == ["city", "celsius"]


def test_a_first_token_the_pods_disagree_on_fails_the_request(tokenizer):
    """A prefill pod that sampled under the grammar (fingerprint) gives its token to the client; a
    decode pod whose index 0 then differs (it refused the token and prefilled itself) fails the
    request rather than let the text continue from a token its grammar never saw."""
    body = {"model": "fake-model", "messages": MESSAGES, "max_tokens": 10, "guided_regex": "[a-z]+"}
    with RouterThread(tokenizer, prefill=[Script(output_token_ids=ids("abc"), grammar_fingerprint="fp")],
                      decode=[Script(output_token_ids=ids("xyz"))]) as thread:
        h = thread.harness
        response = httpx.post(h.url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 502 and response.json()["error"]["code"] == "structured_output_handoff"
        # Agreeing pods: P's token is given, D continues.
        h.decode[0].script.output_token_ids = ids("abc")
        assert httpx.post(h.url + "/v1/chat/completions", json=body, timeout=30).json()[
            "choices"][0]["message"]["content"] == "abc"
        # A prefill pod that did not constrain (no fingerprint): its token is never given out, D's is.
        h.prefill[0].script.grammar_fingerprint = ""
        h.decode[0].script.output_token_ids = ids("xyz")
        assert httpx.post(h.url + "/v1/chat/completions", json=body, timeout=30).json()[
            "choices"][0]["message"]["content"] == "xyz"
