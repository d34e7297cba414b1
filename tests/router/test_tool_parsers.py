"""Tool-call parsers on fixed texts: every format, several calls, text before and after calls,
malformed and truncated JSON; and streaming split at every position equals parsing the whole."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.tools.formats import HERMES, JSON_LIST, LLAMA3_JSON, MISTRAL
from router.tools.stream import ToolCallStream


def _ids():
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def collect(events):
    """(content or None, [(id, name, arguments)]) from a list of events."""
    content, calls = "", []
    for e in events:
        if e.kind == "content":
            content += e.text
        elif e.kind == "open":
            assert e.index == len(calls)
            calls.append([e.call_id, e.name, ""])
        else:
            calls[e.index][2] += e.text
    return content or None, [tuple(c) for c in calls]


def whole(fmt, text):
    stream = ToolCallStream(fmt.parse, _ids())
    return collect(stream.feed(text) + stream.finish())


def pieces(fmt, parts):
    stream = ToolCallStream(fmt.parse, _ids())
    events = []
    for part in parts:
        events += stream.feed(part)
    return collect(events + stream.finish())


def assert_every_split(fmt, text):
    expected = whole(fmt, text)
    for i in range(len(text) + 1):
        assert pieces(fmt, [text[:i], text[i:]]) == expected, (text, i)
    assert pieces(fmt, list(text)) == expected, text      # one character at a time
    return expected


ARGS = '{"city": "Paris", "days": [1, 2.5e3, -0], "ok": true, "note": "a \\"q\\" \\u00e9 </tool_call>"}'

CASES = [
    # (format, text, expected content, expected [(name, arguments)])
    (HERMES, f'<tool_call>\n{{"name": "weather", "arguments": {ARGS}}}\n</tool_call>', None,
     [("weather", ARGS)]),
    (HERMES, 'Let me check.\n\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
             '{"name": "b", "arguments": {"x": 1}}\n</tool_call>\n', "Let me check.",
     [("a", "{}"), ("b", '{"x": 1}')]),
    (HERMES, 'plain answer, no call', "plain answer, no call", []),
    (HERMES, 'a <tool_call> that is not json', "a <tool_call> that is not json", []),
    (HERMES, '<tool_call>\n{"name": "f"}\n</tool_call>', None, [("f", "{}")]),            # no arguments
    (HERMES, '<tool_call>\n{"arguments": {"k": 2}, "name": "f"}\n</tool_call>', None, [("f", '{"k": 2}')]),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": tru}}', "}}", [("f", '{"a": tru')]),  # malformed
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', None, [("f", '{"a": [1, 2')]),  # truncated
    (HERMES, '<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),  # cut before commit
    (HERMES, '<tool_call>{"name": "f", "arguments": {}}</tool_call> and then text', " and then text", [("f", "{}")]),
    (HERMES, '<tool_call>{"name": "f", "arguments": {}} trailing', " trailing", [("f", "{}")]),   # no end marker
    (HERMES, 'x <tool_ca', "x <tool_ca", []),                                                   # partial marker
    (HERMES, '  \n', "  \n", []),
    (LLAMA3_JSON, '{"name": "f", "parameters": {"a": 1}}', None, [("f", '{"a": 1}')]),
    (LLAMA3_JSON, ' <|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": "x"}}',
     None, [("f", "{}"), ("g", '{"b": "x"}')]),
    (LLAMA3_JSON, 'I will not call anything {"name": "f"}', 'I will not call anything {"name": "f"}', []),
    (LLAMA3_JSON, '{"answer": 42}', '{"answer": 42}', []),                                    # JSON, not a call
    (LLAMA3_JSON, '{"name": "f", "parameters": {}} and some words', " and some words", [("f", "{}")]),
    (LLAMA3_JSON, '{"name": "f", "parameters": {}}; oops', "; oops", [("f", "{}")]),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', None,
     [("f", '{"a": 1}'), ("g", "{}")]),
    (MISTRAL, 'Sure. [TOOL_CALLS] [ {"name": "f", "arguments": {"a": "]"}} ]', "Sure.", [("f", '{"a": "]"}')]),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]other[ARGS] {}', None,
     [("get_weather", '{"city": "Oslo"}'), ("other", "{}")]),
    (MISTRAL, '[TOOL_CALLS] bad name![ARGS]{}', "[TOOL_CALLS] bad name![ARGS]{}", []),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {}}, 7]', ", 7]", [("f", "{}")]),
    (JSON_LIST, '[{"name": "f", "parameters": {"q": null}}, {"name": "g", "parameters": {}}]', None,
     [("f", '{"q": null}'), ("g", "{}")]),
    (JSON_LIST, 'not a list', "not a list", []),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES, ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_fixed_texts_parse_and_stream_the_same_at_every_split(fmt, text, content, calls):
    got_content, got_calls = assert_every_split(fmt, text)
    assert got_content == content
    assert [(name, args) for _, name, args in got_calls] == calls
    for _, _, args in got_calls:
        if text.rstrip().endswith(("}", "]", "</tool_call>")) and "tru}" not in text:
            json.loads(args)


def test_ids_are_openai_style_or_nine_alphanumerics_for_mistral():
    for fmt, prefix, length in ((HERMES, "call_", 29), (MISTRAL, "", 9)):
        stream = ToolCallStream(fmt.parse)
        text = ('<tool_call>{"name": "f", "arguments": {}}</tool_call>' if fmt is HERMES
                else '[TOOL_CALLS][{"name": "f", "arguments": {}}]')
        (call_id, _, _), = collect(stream.feed(text) + stream.finish())[1]
        assert call_id.startswith(prefix) and len(call_id) == length and call_id.isascii()
        assert call_id.replace("_", "").isalnum()


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([HERMES, LLAMA3_JSON, MISTRAL, JSON_LIST]),
       st.lists(st.tuples(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), st.dictionaries(st.text(max_size=5),
                                                                                       _json_values, max_size=3)),
                min_size=1, max_size=3),
       st.text(alphabet="ab \n<{", max_size=6), st.integers(0, 10_000), st.integers(0, 2))
def test_generated_calls_round_trip_at_random_splits(fmt, calls, before, seed, indent):
    key = "parameters" if fmt in (LLAMA3_JSON, JSON_LIST) else "arguments"
    objects = [json.dumps({"name": n, key: a}, indent=indent or None) for n, a in calls]
    if fmt is HERMES:
        text = before + "".join(f"<tool_call>\n{o}\n</tool_call>\n" for o in objects)
    elif fmt is MISTRAL:
        text = before + "[TOOL_CALLS][" + ", ".join(objects) + "]"
    elif fmt is LLAMA3_JSON:
        text = "; ".join(objects)
    else:
        text = "[" + ", ".join(objects) + "]"
    content, got = whole(fmt, text)
    assert [(name, json.loads(args)) for _, name, args in got] == [(n, a) for n, a in calls]
    if fmt in (HERMES, MISTRAL):
        expected_content = before.rstrip(" \n") or None
        if "<tool_call>" not in before and "[TOOL_CALLS]" not in before:
            assert content == expected_content
    # Random split points (every split is covered by the fixed texts above).
    import random
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(4, len(text) + 1)))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert pieces(fmt, parts) == (content, got)
