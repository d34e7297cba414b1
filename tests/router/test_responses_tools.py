"""Function tools, reasoning and `text.format` on `POST /v1/responses`, through the `openai`
client, against fake pods that write fixed texts: the output items (reasoning, message,
function calls), the typed stream events that build exactly those items, P/D equal to
colocated, conversation items rendered as the chat template's tool turns, forcing grammars and
schemas equal to chat's for the same request, and the 400s naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine.sampling.params import from_proto
from fake_pods import BYTE_OFFSET, Script
from router_harness import RouterThread, byte_tokenizer_with_template

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now", "parameters": SCHEMA},
         {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
HERMES_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"FR\\" é"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
# Renders what the mapping must carry: tools, calls with their arguments and ids, tool results, thinking.
TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}: {{ t.function.parameters | tojson }}]{% endfor %}"
            "{% for m in messages %}<{{ m.role }}>"
            "{% if m.reasoning_content %}(thought {{ m.reasoning_content }}){% endif %}{{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }} "
            "{{ c.function.arguments | tojson }}){% endfor %}"
            "{% if m.tool_call_id %}(result of {{ m.tool_call_id }}){% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def ids(text: str) -> list[int]:
    return [BYTE_OFFSET + b for b in text.encode()]


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    return byte_tokenizer_with_template(tmp_path_factory.mktemp("tool-template"), TEMPLATE)


@pytest.fixture(scope="module")
def routers(tool_tokenizer):
    """Colocated and P/D routers with the hermes parser, auto tool choice and deepseek_r1 reasoning;
    a plain one (no parser)."""
    kwargs = dict(tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="deepseek_r1")
    with RouterThread(tool_tokenizer, colocated=[Script(max_model_len=2048, tokens_per_message=3)], **kwargs) as co, \
            RouterThread(tool_tokenizer, prefill=[Script(max_model_len=2048)], decode=[Script(max_model_len=2048)],
                         **kwargs) as pd, \
            RouterThread(tool_tokenizer, colocated=[Script(max_model_len=2048)]) as plain:
        yield {"co": co.harness, "pd": pd.harness, "plain": plain.harness}


def script(harness, text: str) -> None:
    for pod in harness.pods:
        pod.script.output_token_ids = ids(text)


def client(harness) -> openai.OpenAI:
    return openai.OpenAI(base_url=harness.url + "/v1", api_key="x", max_retries=0, timeout=30)


def last_sent(harness):
    """The prompt ids and SamplingParams of the last request the first pod that runs prompts saw."""
    pod = (harness.prefill or harness.colocated)[0]
    sent = pod.records.prefill_requests[-1] if harness.prefill else pod.records.generate_requests[-1]
    return list(sent.prompt_token_ids), from_proto(sent.sampling)


def items_without_ids(output) -> list[dict]:
    return [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")} for item in output]


@pytest.mark.parametrize("layout", ["co", "pd"])
def test_function_calls_stream_to_exactly_the_whole_response(routers, tool_tokenizer, layout):
    h = routers[layout]
    script(h, "<think>hmm</think>" + HERMES_TEXT)
    sdk = client(h)
    body = dict(model="fake-model", input="weather in Paris and the time?", tools=TOOLS, max_output_tokens=400)
    whole = sdk.responses.create(**body)
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call", "function_call"]
    reasoning, message, weather, time_call = whole.output
    assert reasoning.content[0].text == "hmm" and whole.output_text == "Let me look."
    assert (weather.name, json.loads(weather.arguments)) == ("get_weather", {"city": 'Paris "FR" é'})
    assert (time_call.name, time_call.arguments) == ("get_time", "{}")
    assert weather.call_id.startswith("call_") and weather.call_id != time_call.call_id
    assert whole.status == "completed" and all(item.status == "completed" for item in whole.output)
    assert [t.name for t in whole.tools] == ["get_weather", "get_time"]
    prompt, _ = last_sent(h)
    assert prompt == tool_tokenizer.encode_chat([{"role": "user", "content": "weather in Paris and the time?"}],
                                                tools=CHAT_TOOLS)

    events = list(sdk.responses.create(**body, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert items_without_ids(final.output) == items_without_ids(whole.output)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.id for i in added] == [i.id for i in done] == [i.id for i in final.output]
    for index, item in enumerate(final.output):   # each item's events lie between its added and done
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        assert mine[0].type == "response.output_item.added" and mine[-1].type == "response.output_item.done"
        assert all(e.item_id == item.id for e in mine if hasattr(e, "item_id"))
        text = "".join(e.delta for e in mine if e.type.endswith(".delta"))
        if item.type == "function_call":
            assert text == item.arguments == next(e.arguments for e in mine
                                                  if e.type == "response.function_call_arguments.done")
        else:
            assert text == item.content[0].text


def test_conversation_items_render_as_chat_tool_turns(routers, tool_tokenizer):
    h = routers["co"]
    script(h, "</think>It is sunny.")
    items = [{"role": "user", "content": "weather and time?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "two tools"}]},
             {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call", "call_id": "call_b", "name": "get_time", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_b",
              "output": [{"type": "input_text", "text": "noon"}]}]
    response = client(h).responses.create(model="fake-model", input=items, tools=TOOLS, instructions="Be brief.",
                                          max_output_tokens=50)
    assert response.output_text == "It is sunny." and [i.type for i in response.output] == ["message"]
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather and time?"},
                {"role": "assistant", "content": None, "reasoning_content": "two tools", "tool_calls": [
                    {"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Oslo"}}},
                    {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_a"},
                {"role": "tool", "content": "noon", "tool_call_id": "call_b"}]
    prompt, _ = last_sent(h)
    assert prompt == tool_tokenizer.encode_chat(expected, tools=CHAT_TOOLS)
    assert "(call call_a get_weather {\"city\": \"Oslo\"})" in tool_tokenizer.decode(prompt)


def chat_spec(harness, body: dict):
    response = httpx.post(harness.url + "/v1/chat/completions", timeout=30, json={
        "model": "fake-model", "messages": [{"role": "user", "content": "q"}], "max_tokens": 200, **body})
    assert response.status_code == 200, response.text
    return last_sent(harness)[1]


def test_tool_choice_and_text_format_are_chats_constraints(routers):
    h = routers["plain"]
    script(h, '[{"name": "get_time", "parameters": {}}]')
    sdk = client(h)
    cases = [({"tools": TOOLS, "tool_choice": "required"}, {"tools": CHAT_TOOLS, "tool_choice": "required"}),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}},
              {"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
             ({"text": {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}}},
              {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}}),
             ({"text": {"format": {"type": "json_object"}}}, {"response_format": {"type": "json_object"}})]
    for responses_fields, chat_fields in cases:
        response = sdk.responses.create(model="fake-model", input="q", max_output_tokens=200, **responses_fields)
        spec = last_sent(h)[1].structured
        assert spec is not None and spec == chat_spec(h, chat_fields).structured, responses_fields
        if "tools" in responses_fields:   # forced, without a parser: vLLM's JSON list is read back as calls
            ((call,),) = [[i for i in response.output if i.type == "function_call"]]
            assert (call.name, call.arguments) == ("get_time", "{}") and response.status == "completed"


@pytest.mark.parametrize("layout, fields, param", [
    ("co", {"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ("co", {"tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name"),
    ("co", {"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]}, "tools[0].parameters"),
    ("co", {"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ("co", {"tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ("plain", {"tools": TOOLS}, "tool_choice"),     # auto needs a parser and --enable-auto-tool-choice
    ("co", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
    ("co", {"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ("co", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]}, "input"),
])
def test_bad_tools_and_formats_are_400s_naming_the_field(routers, layout, fields, param):
    h = routers[layout]
    before = sum(p.records.num_requests for p in h.pods)
    response = httpx.post(h.url + "/v1/responses", timeout=30, json={"model": "fake-model", "input": "hi", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"], error
    assert sum(p.records.num_requests for p in h.pods) == before
