"""Output constraints and tools through the router's HTTP surface (fake pods): every error path is a
400 naming the field, before any pod is called; and what the pods receive is the one canonical
`StructuredSpec` (and the sampling flags) the request asked for."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.grammar.spec import canonical_json
from fake_pods import Script
from router_harness import RouterThread, byte_tokenizer_with_template

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["city"]}


def tool(name="get_weather", parameters=None):
    return {"type": "function", "function": {"name": name, "description": "d",
                                             "parameters": parameters if parameters is not None else SCHEMA}}


@pytest.fixture(scope="module")
def plain(tokenizer):
    with RouterThread(tokenizer, colocated=[Script()], max_schema_bytes=4096, max_schema_depth=8) as thread:
        yield thread.harness


@pytest.fixture(scope="module")
def hermes(tokenizer):
    with RouterThread(tokenizer, colocated=[Script()], tool_call_parser="hermes", enable_auto_tool_choice=True,
                      reasoning_parser="deepseek_r1") as thread:
        yield thread.harness


def post(harness, path, body):
    return httpx.post(harness.url + path, json={"model": "fake-model", "max_tokens": 4, **body}, timeout=30)


def last_sampling(harness):
    return harness.colocated[0].records.generate_requests[-1].sampling


# (name, path, body, param, words the message must contain)
ERRORS = [
    ("json_schema without json_schema", CHAT, {"response_format": {"type": "json_schema"}},
     "response_format.json_schema", ["required"]),
    ("json_schema name pattern", CHAT,
     {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
     "response_format", ["name"]),
    ("invalid schema type", CHAT,
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", ["strin"]),
    ("unsupported schema keyword", COMPLETIONS,
     {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema", ["uniqueItems"]),
    ("unknown string format", CHAT, {"structured_outputs": {"json": {"type": "string", "format": "weird"}}},
     "structured_outputs.json", ["format", "weird"]),
    ("dangling $ref", CHAT, {"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json", ["defs/missing"]),
    ("guided_json not JSON", CHAT, {"guided_json": "{oops"}, "guided_json", ["JSON"]),
    ("unclosed regex group", COMPLETIONS, {"prompt": "a", "structured_outputs": {"regex": "a(b"}},
     "structured_outputs.regex", ["unclosed group"]),
    ("look-around regex", CHAT, {"guided_regex": "(?=a)b"}, "guided_regex", ["look-around"]),
    ("lark with an unknown rule", CHAT, {"structured_outputs": {"grammar": "start: foo\n"}},
     "structured_outputs.grammar", ["foo"]),
    ("empty grammar", CHAT, {"guided_grammar": "  "}, "guided_grammar", ["empty"]),
    ("empty choice list", CHAT, {"guided_choice": []}, "guided_choice", []),
    ("two constraint kinds", CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "guided_regex", ["only one"]),
    ("two keys in structured_outputs", CHAT, {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs.choice", ["only one"]),
    ("structured_outputs without a kind", CHAT, {"structured_outputs": {"disable_any_whitespace": True}},
     "structured_outputs", ["one of"]),
    ("unknown structured_outputs key", CHAT, {"structured_outputs": {"regexp": "a"}}, "structured_outputs",
     ["regexp"]),
    ("whitespace_pattern", CHAT, {"structured_outputs": {"json_object": True, "whitespace_pattern": " ?"}},
     "structured_outputs.whitespace_pattern", ["not supported"]),
    ("guided_whitespace_pattern", CHAT, {"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
     "guided_whitespace_pattern", ["not supported"]),
    ("another backend", COMPLETIONS, {"prompt": "a", "guided_regex": "a", "guided_decoding_backend": "xgrammar"},
     "guided_decoding_backend", ["llguidance"]),
    ("structural_tag", CHAT, {"response_format": {"type": "structural_tag"}}, "response_format.type",
     ["structural_tag"]),
    ("schema over --max-schema-bytes", CHAT,
     {"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(400)}}},
     "guided_json", ["max-schema-bytes"]),
    ("schema over --max-schema-depth", CHAT, {"guided_json": {"type": "array", "items": {"items": {"items": {
        "items": {"items": {"items": {"items": {"type": "array", "items": {"type": "string"}}}}}}}}}},
     "guided_json", ["nested 9 levels", "max-schema-depth"]),
    ("tool parameters over the depth", CHAT,
     {"tools": [tool(parameters={"a": [[[[[[[[1]]]]]]]]})], "tool_choice": "none"},
     "tools[0].function.parameters", ["max-schema-depth"]),
    ("too many tools", CHAT, {"tools": [tool(f"t{i}") for i in range(129)], "tool_choice": "required"},
     "tools", ["at most 128", "max-tools"]),
    ("tool name with a space", CHAT, {"tools": [tool("get weather")], "tool_choice": "required"},
     "tools[0].function.name", ["[a-zA-Z0-9_-]"]),
    ("two tools of one name", CHAT, {"tools": [tool("f"), tool("f")], "tool_choice": "required"},
     "tools[1].function.name", ["two tools"]),
    ("invalid tool schema", CHAT, {"tools": [tool("f"), tool("g", {"type": "integr"})], "tool_choice": "required"},
     "tools[1].function.parameters", ["integr"]),
    ("named tool that is not there", CHAT,
     {"tools": [tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", ["'g'"]),
    ("named tool without tools", CHAT, {"tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", ["no tools"]),
    ("auto without a parser", CHAT, {"tools": [tool()]}, "tool_choice", ["--enable-auto-tool-choice"]),
    ("tools and functions", CHAT, {"tools": [tool()], "functions": [tool()["function"]]}, "functions", ["not both"]),
    ("legacy function_call names nothing", CHAT,
     {"functions": [tool()["function"]], "function_call": {"name": "nope"}}, "function_call", ["'nope'"]),
    ("unknown tool_choice", CHAT, {"tools": [tool()], "tool_choice": "sometimes"}, "tool_choice", []),
    ("tool without function", CHAT, {"tools": [{"type": "function"}]}, "tools", []),
    ("reserved chat_template_kwargs", CHAT, {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs",
     ["tools"]),
]


@pytest.mark.parametrize("name,path,body,param,words", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_constraints_and_tools_are_400s_naming_the_field(plain, name, path, body, param, words):
    before = plain.num_pod_requests()
    if path == CHAT:
        body = {"messages": MESSAGES, **body}
    response = post(plain, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    assert plain.num_pod_requests() == before


def test_a_lark_grammar_next_to_auto_tools_is_refused(hermes):
    response = post(hermes, CHAT, {"messages": MESSAGES, "tools": [tool()],
                                   "structured_outputs": {"grammar": 'start: "a"'}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "structured_outputs.grammar"


# (body, kind, text) the colocated pod must receive
SPECS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", canonical_json(SCHEMA)),
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"structured_outputs": {"json_object": True}}, "json_object", ""),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", canonical_json(SCHEMA)),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "guidance"}, "json_schema", canonical_json(SCHEMA)),
    ({"structured_outputs": {"regex": r"\d{3}-[a-z]+"}}, "regex", r"\d{3}-[a-z]+"),
    ({"guided_regex": "yes|no"}, "regex", "yes|no"),
    ({"structured_outputs": {"choice": ["b", "a"]}}, "choice", '["b","a"]'),
    ({"guided_choice": ["x"]}, "choice", '["x"]'),
    ({"structured_outputs": {"grammar": 'start: "yes" | "no"'}}, "lark", 'start: "yes" | "no"'),
]


@pytest.mark.parametrize("body,kind,text", SPECS, ids=[f"{s[1]}-{i}" for i, s in enumerate(SPECS)])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_each_surface_sends_one_canonical_spec(plain, path, body, kind, text):
    body = {**body, **({"messages": MESSAGES} if path == CHAT else {"prompt": "a"})}
    response = post(plain, path, body)
    assert response.status_code == 200, response.text
    structured = last_sampling(plain).structured
    assert (structured.kind, structured.text, structured.any_whitespace) == (kind, text, False)
    assert list(structured.after_token_ids) == []


def test_gbnf_becomes_lark_and_options_arrive(plain):
    post(plain, CHAT, {"messages": MESSAGES, "guided_grammar": 'root ::= "yes" | "no"'})
    structured = last_sampling(plain).structured
    assert structured.kind == "lark" and "start:" in structured.text and "::=" not in structured.text
    post(plain, CHAT, {"messages": MESSAGES, "structured_outputs": {
        "json": {"type": "object", "properties": {"a": {"type": "object"}}}, "disable_any_whitespace": False,
        "disable_additional_properties": True}})
    structured = last_sampling(plain).structured
    assert structured.any_whitespace is True
    schema = json.loads(structured.text)
    assert schema["additionalProperties"] is False and schema["properties"]["a"]["additionalProperties"] is False


def test_no_constraint_sends_no_spec(plain):
    post(plain, CHAT, {"messages": MESSAGES, "response_format": {"type": "text"}})
    assert not last_sampling(plain).HasField("structured")


def test_forced_tool_calls_are_a_grammar_in_the_parser_format(hermes, plain):
    tools = [tool("get_weather"), tool("get_time", {"type": "object", "properties": {}})]
    assert post(hermes, CHAT, {"messages": MESSAGES, "tools": tools, "tool_choice": "required"}).status_code == 200
    grammar = last_sampling(hermes).structured
    assert grammar.kind == "lark"
    assert '"<tool_call>"' in grammar.text and '"</tool_call>"' in grammar.text and "call)*" in grammar.text
    assert '{"const": "get_weather"}' in grammar.text and '{"const": "get_time"}' in grammar.text
    # deepseek_r1: the grammar starts after the thinking.
    assert bytes(t - 4 for t in grammar.after_token_ids) == b"</think>"

    named = {"type": "function", "function": {"name": "get_time"}}
    post(hermes, CHAT, {"messages": MESSAGES, "tools": tools, "tool_choice": named})
    grammar = last_sampling(hermes).structured.text
    assert '"get_time"' in grammar and '"get_weather"' not in grammar and "call)*" not in grammar
    post(hermes, CHAT, {"messages": MESSAGES, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    assert "call)*" not in last_sampling(hermes).structured.text

    # No parser configured: vLLM's plain JSON list of {name, parameters}.
    post(plain, CHAT, {"messages": MESSAGES, "tools": tools, "tool_choice": "required"})
    grammar = last_sampling(plain).structured.text
    assert 'calls: LEAD? "[" call (", " call)* "]"' in grammar and '"parameters"' in grammar


def test_auto_tools_are_free_unless_a_format_is_asked_for(hermes):
    post(hermes, CHAT, {"messages": MESSAGES, "tools": [tool()]})
    assert not last_sampling(hermes).HasField("structured")
    post(hermes, CHAT, {"messages": MESSAGES, "tools": [tool()], "response_format": {"type": "json_object"}})
    grammar = last_sampling(hermes).structured.text
    assert "start: calls | answer" in grammar and "answer: %json" in grammar
    post(hermes, CHAT, {"messages": MESSAGES, "tools": [tool()], "tool_choice": "none",
                        "response_format": {"type": "json_object"}})
    assert last_sampling(hermes).structured.kind == "json_object"


def test_auto_with_a_strict_tool_is_calls_or_text_without_a_call(hermes, tokenizer):
    """`strict: true` under `auto`: a call must be a valid one; free text may not hold a call
    (the hermes marker is text in this vocabulary, so the grammar excludes it)."""
    from engine.grammar.llguidance_backend import LLGuidanceBackend
    from engine.grammar.spec import StructuredSpec

    strict = tool()
    strict["function"]["strict"] = True
    post(hermes, CHAT, {"messages": MESSAGES, "tools": [strict, tool("get_time", {"type": "object"})]})
    sent = last_sampling(hermes).structured
    assert sent.kind == "lark" and "start: calls | answer" in sent.text and list(sent.after_token_ids)
    backend = LLGuidanceBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    grammar = backend.compile(StructuredSpec("lark", sent.text))

    def accepts(text: str, complete: bool = True) -> bool:
        matcher = grammar.matcher()
        return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and (
            not complete or matcher.can_accept(tokenizer.eos_token_ids[0]))
    assert accepts("It is sunny in Oslo.") and accepts("")
    assert accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"n": 1}}', complete=False)
    assert not accepts('<tool_call>\n{"name": "nope"', complete=False)
    assert not accepts("Calling it: <tool_call>", complete=False)


def test_tools_reach_the_chat_template(tmp_path):
    template = ("{% for t in tools or [] %}[{{ t.function.name }}:{{ t.function.parameters | tojson }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
                "{% for c in m.tool_calls or [] %}({{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }})"
                "{% endfor %}{{ m.tool_call_id or '' }}{% endfor %}{{ flag }}")
    custom = byte_tokenizer_with_template(tmp_path, template)
    with RouterThread(custom, colocated=[Script()], exclude_tools_when_tool_choice_none=True) as thread:
        h = thread.harness
        messages = [{"role": "user", "content": "weather?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        post(h, CHAT, {"messages": messages, "tools": [tool()], "tool_choice": "required",
                       "chat_template_kwargs": {"flag": "!"}})
        prompt = custom.decode(h.colocated[0].records.generate_requests[-1].prompt_token_ids)
        assert prompt == ('[get_weather:' + json.dumps(SCHEMA) + ']<user>weather?<assistant>(call_1 get_weather Oslo)'
                          '<tool>sunnycall_1!')
        post(h, CHAT, {"messages": MESSAGES, "tools": [tool()], "tool_choice": "none"})
        prompt = custom.decode(h.colocated[0].records.generate_requests[-1].prompt_token_ids)
        assert prompt == "<user>hi"       # --exclude-tools-when-tool-choice-none


def test_a_special_token_marker_is_forced_as_the_token_and_kept_in_the_text(tmp_path):
    custom = byte_tokenizer_with_template(tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}",
                                          special_tokens=("[TOOL_CALLS]",))
    marker = custom.token_to_id("[TOOL_CALLS]")
    with RouterThread(custom, colocated=[Script()], tool_call_parser="mistral") as thread:
        h = thread.harness
        post(h, CHAT, {"messages": MESSAGES, "tools": [tool()], "tool_choice": "required"})
        sampling = last_sampling(h)
        assert f"<[{marker}]>" in sampling.structured.text and '"[TOOL_CALLS]"' not in sampling.structured.text
        assert sampling.skip_special_tokens is False          # the parser must see the marker
        post(h, CHAT, {"messages": MESSAGES, "tools": [tool()], "tool_choice": "none"})
        assert last_sampling(h).skip_special_tokens is True   # no calls read: untouched


def test_plain_markers_leave_special_tokens_skipped(hermes):
    post(hermes, CHAT, {"messages": MESSAGES, "tools": [tool()], "tool_choice": "required"})
    assert last_sampling(hermes).skip_special_tokens is True
