"""Tool calling end to end, one router per model family (its real tool-capable chat template and
`--tool-call-parser`) over a prefill and a decode pod with random weights: forced calls come out
in the family's own format and parse into OpenAI `tool_calls` whose arguments fit the tool's
schema; a conversation with earlier calls and their results renders and continues; the SDK's
stream accumulator rebuilds the non-streamed message; P/D equals colocated; reasoning models
think unconstrained and answer under the grammar."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from model_dirs import DEEPSEEK_R1, LLAMA31, MISTRAL, QWEN25

pytestmark = pytest.mark.slow
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "system", "content": "You call tools."}, {"role": "user", "content": "Weather in Oslo?"}]
PARSERS = {"hermes": QWEN25, "llama3_json": LLAMA31, "mistral": MISTRAL, None: QWEN25}


@pytest.fixture(scope="module")
def family(routers):
    started = {}

    def get(parser, **config):
        key = (parser, tuple(sorted(config.items())))
        if key not in started:
            flags = dict(tool_call_parser=parser, enable_auto_tool_choice=True) if parser else {}
            started[key] = routers.start(f"{parser}-{len(started)}", PARSERS[parser], **flags, **config)
        return started[key]
    return get


def check_calls(message, names=None, count=None):
    calls = message.tool_calls or []
    assert calls, message
    if count is not None:
        assert len(calls) == count
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", None], ids=str)
def test_required_and_named_calls_in_each_format(family, parser):
    router = family(parser)
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0.8, seed=2)
    with ThreadPoolExecutor(2) as pool:
        required = pool.submit(router.client.chat.completions.create, tool_choice="required",
                               parallel_tool_calls=False, **kwargs)
        named = pool.submit(router.client.chat.completions.create,
                            tool_choice={"type": "function", "function": {"name": "get_time"}}, **kwargs)
        required, named = required.result(), named.result()
    for result, names in ((required, None), (named, ["get_time"])):
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        (call,) = check_calls(choice.message, names, count=1)
        if parser == "mistral":
            assert len(call.id) == 9 and call.id.isalnum()
        else:
            assert call.id.startswith("call_")


def test_a_conversation_with_calls_and_results_continues(family):
    """Each template renders the assistant's earlier calls (arguments as dicts) and the results."""
    for parser in ("hermes", "llama3_json", "mistral"):
        router = family(parser)
        first = router.client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=120, temperature=0.0)
        call = first.choices[0].message.tool_calls[0]
        messages = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
        second = router.client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                                       tool_choice="none", max_tokens=8, temperature=0.0)
        assert second.choices[0].finish_reason in ("stop", "length") and second.usage.prompt_tokens > \
            first.usage.prompt_tokens


def test_the_sdk_stream_accumulator_rebuilds_the_message(family):
    router = family("hermes")
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=150,
                  temperature=0.0)
    whole = router.client.chat.completions.create(**kwargs)
    with router.client.chat.completions.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in events
    got, want = final.choices[0], whole.choices[0]
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in want.message.tool_calls]
    assert got.finish_reason == want.finish_reason and got.message.content == want.message.content


def test_tool_calls_disaggregated_equal_colocated(family, routers):
    pd = family("hermes")
    colocated = routers.start("hermes-colocated", QWEN25, colocated=True, tool_call_parser="hermes",
                              enable_auto_tool_choice=True)
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=100,
                  temperature=0.9, seed=4, n=2)
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda r: r.client.chat.completions.create(**kwargs), (pd, colocated))
    calls = [[[(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
              for choice in out.choices] for out in (a, b)]
    assert calls[0] == calls[1] and all(calls[0])


def test_auto_with_a_response_format_gives_calls_or_the_format(family):
    router = family("hermes")
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for seed in range(3):
        result = router.client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}})
        choice = result.choices[0]
        if choice.message.tool_calls:
            check_calls(choice.message)
        elif choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), answer)


def test_a_reasoning_model_answers_under_the_grammar_after_thinking(family, routers):
    # Thinking switched off in the prompt (Qwen3's empty think block): the grammar applies at once.
    qwen3 = family("hermes", reasoning_parser="qwen3")
    result = qwen3.client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=0.0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "guided_json": WEATHER})
    message = result.choices[0].message
    assert result.choices[0].finish_reason == "stop" and message.model_extra.get("reasoning_content") is None
    jsonschema.validate(json.loads(message.content), WEATHER)
    forced = qwen3.client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0.0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    check_calls(forced.choices[0].message)
    # Thinking on, the prompt opening none: the output either thinks (optional block) or answers
    # under the schema at once; never unconstrained content.
    for seed in range(3):
        result = qwen3.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60,
                                                      temperature=1.0, seed=seed, extra_body={"guided_json": WEATHER})
        message = result.choices[0].message
        if result.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(message.content), WEATHER)
        else:            # cut by max_tokens: inside the thinking, or inside the answer
            assert message.model_extra.get("reasoning_content") or message.content.lstrip().startswith("{")
    # DeepSeek-R1 opens the thinking in the prompt: the output is free until </think> (which random
    # weights do not write), all of it reasoning_content, none of it held to the schema.
    r1 = routers.start("r1", DEEPSEEK_R1, reasoning_parser="deepseek_r1")
    result = r1.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=1.0,
                                               seed=9, extra_body={"guided_json": WEATHER})
    message = result.choices[0].message
    assert result.choices[0].finish_reason == "length" and message.content is None
    assert message.model_extra["reasoning_content"]


class Forecast(BaseModel):
    city: str = Field(max_length=6)
    days: int = Field(ge=1, le=7)


def test_the_sdk_parses_strict_pydantic_tools(family):
    """`openai.pydantic_function_tool` (strict) with `parse` and with `stream`: the forced call
    fits the model, so the SDK hands back `parsed_arguments` both ways."""
    router = family("hermes")
    kwargs = dict(model="tiny", messages=MESSAGES, tools=[openai.pydantic_function_tool(Forecast)],
                  tool_choice="required", parallel_tool_calls=False, max_tokens=100, temperature=0.0)
    parsed = router.client.chat.completions.parse(**kwargs)
    (call,) = parsed.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Forecast)
    with router.client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == call.function.parsed_arguments
