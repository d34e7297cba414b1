"""Units of the router's structured-output side: the validator (limits, canonical specs, the
verdict cache), the reasoning splitter on fixed texts at every split point, and where a grammar
starts for a reasoning model."""

from __future__ import annotations

import llguidance
import pytest

from engine.grammar.spec import canonical_json
from router.errors import APIError
from router.reasoning.parser import REASONING_PARSERS, ReasoningStream, initial_state
from router.structured.surface import Constraint
from router.structured.validate import SpecValidator, StructuredLimits, json_depth, no_additional_properties
from router.tools.grammar import regex_answer


def test_json_depth_and_additional_properties():
    assert [json_depth(v) for v in (1, {}, [[]], {"a": [{"b": 1}]})] == [0, 1, 2, 3]
    assert json_depth(_nested(10_000)) == 10_001           # iterative: no recursion limit
    schema = {"type": "object", "properties": {"a": {"type": "object"}, "b": {"additionalProperties": True,
                                                                               "properties": {}}}}
    out = no_additional_properties(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["b"]["additionalProperties"] is True and "additionalProperties" not in schema


def _nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


def test_specs_are_canonical_and_gbnf_becomes_lark(tokenizer):
    validator = SpecValidator(StructuredLimits(), tokenizer.to_json(), tokenizer.eos_token_ids)
    a = validator.spec_for(Constraint("json_schema", {"type": "object", "required": ["x"]}, "p"))
    b = validator.spec_for(Constraint("json_schema", {"required": ["x"], "type": "object"}, "p"))
    assert a == b and a.text == canonical_json({"type": "object", "required": ["x"]})
    lark = validator.spec_for(Constraint("grammar", 'root ::= "a" | "b"', "p"), after_token_ids=(5, 6))
    assert lark.kind == "lark" and "start" in lark.text and lark.after_token_ids == (5, 6)
    assert validator.spec_for(Constraint("choice", ["é", "b"], "p")).text == '["é","b"]'


def test_special_token_references_are_checked_with_the_tokenizer(tokenizer):
    validator = SpecValidator(StructuredLimits(), tokenizer.to_json(), tokenizer.eos_token_ids)
    validator.spec_for(Constraint("grammar", 'start: <[5]> "a"', "p"))
    with pytest.raises(APIError, match="Token range end too large"):
        validator.spec_for(Constraint("grammar", 'start: <[99999]> "a"', "g"))
    without = SpecValidator(StructuredLimits())            # no tokenizer: only a warning, accepted
    without.spec_for(Constraint("grammar", 'start: <[99999]> "a"', "g"))


def test_verdicts_are_remembered(tokenizer, monkeypatch):
    validator = SpecValidator(StructuredLimits(), tokenizer.to_json(), tokenizer.eos_token_ids)
    calls = []
    real = llguidance.LLMatcher.validate_grammar_with_warnings

    def counting(grammar, tok=None):
        calls.append(grammar)
        return real(grammar, tok)

    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar_with_warnings", staticmethod(counting))
    for _ in range(3):
        validator.spec_for(Constraint("regex", "a+", "p"))
        with pytest.raises(APIError, match="unclosed"):
            validator.spec_for(Constraint("regex", "a(", "q"))
    assert len(calls) == 2


def test_size_limit_names_the_flag():
    validator = SpecValidator(StructuredLimits(max_schema_bytes=10))
    with pytest.raises(APIError) as e:
        validator.spec_for(Constraint("regex", "a" * 11, "guided_regex"))
    assert e.value.param == "guided_regex" and e.value.code == "schema_too_large"
    with pytest.raises(ValueError):
        StructuredLimits(max_tools=0)


def test_regex_answers_escape_only_bare_slashes():
    assert regex_answer("a/b") == r"/a\/b/"
    assert regex_answer(r"a\/b") == r"/a\/b/"
    assert regex_answer(r"a\\/b") == r"/a\\\/b/"


# -- reasoning ----------------------------------------------------------------------------------------

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
REASONING_CASES = [
    # (format, prompt end, output, reasoning, content)
    (R1, "", "<think>plan</think>answer", "plan", "answer"),
    (R1, "", "plan</think>\n\nanswer", "plan", "\n\nanswer"),
    (R1, "", "still thinking <thin", "still thinking <thin", ""),
    (R1, "<think>\n", "plan</think>x", "plan", "x"),
    (QWEN3, "", "  <think>a</think>b", "a", "b"),
    (QWEN3, "", "no thinking here </think>", "", "no thinking here </think>"),
    (QWEN3, "", "<thi", "", "<thi"),
    (QWEN3, "<think>\n\n</think>\n\n", "<think>not reasoning</think>", "", "<think>not reasoning</think>"),
    (QWEN3, "<|im_start|>assistant\n<think>\n", "a</think>b", "a", "b"),
]


@pytest.mark.parametrize("fmt,prompt,text,reasoning,content", REASONING_CASES)
def test_reasoning_splits_the_same_at_every_split(fmt, prompt, text, reasoning, content):
    def split(parts):
        stream = ReasoningStream(fmt, prompt)
        events = [e for part in parts for e in stream.feed(part)] + stream.finish()
        return ("".join(e.text for e in events if e.kind == "reasoning"),
                "".join(e.text for e in events if e.kind == "content"))

    assert split([text]) == (reasoning, content)
    for i in range(len(text) + 1):
        assert split([text[:i], text[i:]]) == (reasoning, content), i
    assert split(list(text)) == (reasoning, content)


def test_the_prompt_decides_where_reasoning_starts():
    assert initial_state(QWEN3, "x<think>\n\n</think>\n\n") == "content"
    assert initial_state(R1, "x<think>\n") == "reasoning"
    assert initial_state(R1, "<|im_start|>assistant\n") == "opening"


def test_qwen3_without_an_opened_thinking_gets_an_optional_think_block(tokenizer):
    """A qwen3 model thinks only if its output opens with <think>: the grammar takes either, so a
    model that skips thinking is still held to the schema (and one that thinks, after it)."""
    from engine.grammar.source import grammar_source
    from router.structured.plan import OutputFeatures, chat_plan
    from router.tools.formats import HERMES
    from router.tools.request import FunctionSpec, ToolRequest

    validator = SpecValidator(StructuredLimits(), tokenizer.to_json(), tokenizer.eos_token_ids)
    features = OutputFeatures(validator, tokenizer, HERMES, True, QWEN3)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    lltokenizer = llguidance.LLTokenizer(tokenizer.to_json())

    def accepts(spec, text):
        matcher = llguidance.LLMatcher(lltokenizer, grammar_source(spec), log_level=0)
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    spec = chat_plan(features, Constraint("json_schema", schema, "rf"), None, "<|im_start|>assistant\n").spec
    assert spec.kind == "lark" and spec.after_token_ids == ()
    assert accepts(spec, '{"a":1}') and accepts(spec, '<think>hm, {"a": x}</think>\n\n{"a":2}')
    assert not accepts(spec, '<think>a</think>b</think>{"a":1}') and not accepts(spec, "free text")
    tools = ToolRequest((FunctionSpec("f", None, schema),), "required")
    spec = chat_plan(features, None, tools, "<|im_start|>assistant\n").spec
    assert accepts(spec, '<think>x</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": 3}}\n</tool_call>')
    # The prompt closed the thinking (enable_thinking false): the schema alone, from the start.
    spec = chat_plan(features, Constraint("json_schema", schema, "rf"), None, "x<think>\n\n</think>\n\n").spec
    assert spec.kind == "json_schema" and spec.after_token_ids == ()
    # A Lark grammar has its own start rule: it waits for </think> instead.
    spec = chat_plan(features, Constraint("grammar", 'start: "y"', "g"), None, "<|im_start|>assistant\n").spec
    assert spec.kind == "lark" and bytes(t - 4 for t in spec.after_token_ids) == b"</think>"
