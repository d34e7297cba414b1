"""Output constraints end to end: the real `openai` client, the router, a prefill and a decode pod
with random weights. The model's own distribution is noise, so every valid output is the
grammar's doing: generated schemas, regexes and choices must give 100% valid outputs (an output
cut by `max_tokens` must be a prefix the grammar accepts); P/D equals colocated, greedy and seeded
with n > 1; streaming equals non-streaming; the SDK's `parse` with a pydantic model works.

Requests of one property run concurrently, so the pods batch them (constrained rows next to
each other in one step)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import llguidance
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from engine.grammar.source import grammar_source
from engine.grammar.spec import StructuredSpec, canonical_json
from model_dirs import QWEN25

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Answer in the format."}]
ONE_BATCH = settings(max_examples=1, deadline=None, derandomize=True, phases=[Phase.generate],
                     suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def pd(routers):
    return routers.start("qwen25", QWEN25)


@pytest.fixture(scope="module")
def colocated(routers):
    return routers.start("qwen25-colocated", QWEN25, colocated=True)


def accepted_prefix(router, spec: StructuredSpec, text: str) -> bool:
    """`text` (a `length`-cut output) is a prefix the spec's grammar accepts."""
    tokenizer = router.tokenizer
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(tokenizer.to_json()), grammar_source(spec))
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))


def run_all(requests):
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda request: request(), requests))


# -- generated constraints -------------------------------------------------------------------------

_leaf = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text(alphabet="abcxyz ", min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}),
)


def _object(children):
    def build(props):
        names = list(props)
        return {"type": "object", "properties": props, "required": names[: max(1, len(names) // 2)],
                "additionalProperties": False}
    return st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), children, min_size=1, max_size=3).map(build)


_schema = st.recursive(_leaf, lambda children: st.one_of(
    _object(children),
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)),
    st.lists(children, min_size=2, max_size=2).map(lambda options: {"anyOf": options}),
), max_leaves=5).filter(lambda s: "type" not in s or s["type"] != "null")

_regex_piece = st.sampled_from([r"[a-z]{1,4}", r"\d{2,3}", r"(yes|no)", r"-", r"[A-F0-9]{4}", r"x?", r"\.", r" "])
_regex = st.lists(_regex_piece, min_size=1, max_size=5).map("".join)


@ONE_BATCH
@given(st.lists(_schema, min_size=12, max_size=12))
def test_generated_json_schemas_give_valid_json(pd, schemas):
    def request(i, schema):
        return lambda: pd.client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=160, temperature=1.0, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
    results = run_all([request(i, schema) for i, schema in enumerate(schemas)])
    stops = 0
    for schema, result in zip(schemas, results):
        choice = result.choices[0]
        text = choice.message.content
        if choice.finish_reason == "stop":
            stops += 1
            jsonschema.validate(json.loads(text), schema)
        else:
            assert choice.finish_reason == "length"
            assert accepted_prefix(pd, StructuredSpec("json_schema", canonical_json(schema)), text), (schema, text)
    assert stops >= len(schemas) // 2, "bounded schemas should mostly finish"


@ONE_BATCH
@given(st.lists(_regex, min_size=10, max_size=10))
def test_generated_regexes_fullmatch(pd, patterns):
    def request(i, pattern):
        return lambda: pd.client.completions.create(
            model="tiny", prompt="Say something:", max_tokens=40, temperature=1.0, seed=i,
            extra_body={"structured_outputs": {"regex": pattern}})
    for pattern, result in zip(patterns, run_all([request(i, p) for i, p in enumerate(patterns)])):
        choice = result.choices[0]
        assert choice.finish_reason == "stop", (pattern, choice.text)
        assert re.fullmatch(pattern, choice.text), (pattern, choice.text)


@ONE_BATCH
@given(st.lists(st.lists(st.text(alphabet="abc ✓é", min_size=1, max_size=6), min_size=1, max_size=4, unique=True),
                min_size=8, max_size=8))
def test_generated_choices_pick_one(pd, choice_lists):
    def request(i, choices):
        return lambda: pd.client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=30, temperature=1.0, seed=i, extra_body={"guided_choice": choices})
    for choices, result in zip(choice_lists, run_all([request(i, c) for i, c in enumerate(choice_lists)])):
        assert result.choices[0].finish_reason == "stop" and result.choices[0].message.content in choices


# -- P/D, streaming, the SDK -----------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=11, n=2)],
                         ids=["greedy", "seeded-n2"])
def test_disaggregated_equals_colocated(pd, colocated, sampling):
    outputs = run_all([lambda r=r: r.client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=80, response_format=FORMAT, **sampling) for r in (pd, colocated)])
    texts = [[c.message.content for c in out.choices] for out in outputs]
    assert texts[0] == texts[1]
    for text, choice in zip(texts[0], outputs[0].choices):
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)


def test_streaming_equals_non_streaming(pd):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=80, temperature=0.8, seed=5, response_format=FORMAT)
    whole = pd.client.chat.completions.create(**kwargs)
    chunks = list(pd.client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


class Person(BaseModel):
    name: str = Field(max_length=4)
    mood: Literal["happy", "sad"]
    age: int = Field(ge=0, le=99)


def test_the_sdk_parses_into_a_pydantic_model(pd):
    completion = pd.client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Person,
                                                  max_tokens=80, temperature=0.7, seed=3)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert choice.message.parsed == Person.model_validate_json(choice.message.content)


def test_json_object_mode_gives_an_object(pd):
    result = pd.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0.0,
                                               response_format={"type": "json_object"})
    choice = result.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert accepted_prefix(pd, StructuredSpec("json_object"), choice.message.content)
