"""Specs and validity checks shared by the structured-output tests (engine, async, TP, pods).

The tiny preset's weights are random: whatever valid structure its outputs have comes from the
grammar alone, which is what makes these tests strong.
"""

from __future__ import annotations

import json
import re

import jsonschema

from engine.grammar.spec import StructuredSpec, canonical_json

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "ccc"]}},
                         "ok": {"type": "boolean"}}}
# Short outputs (about 20 bytes) for the tests that run many requests.
SMALL = {"type": "object", "additionalProperties": False, "required": ["n", "b"],
         "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}}}
CODE_REGEX = r"[A-Z]{2}-[0-9]{2,4}(/[a-z]{1,3})?"
CHOICES = ["yes", "no", "maybe so", "n"]


def json_spec(schema: dict = PERSON, **kw) -> StructuredSpec:
    return StructuredSpec("json_schema", canonical_json(schema), **kw)


def regex_spec(pattern: str = CODE_REGEX, **kw) -> StructuredSpec:
    return StructuredSpec("regex", pattern, **kw)


def choice_spec(choices: list[str] = CHOICES, **kw) -> StructuredSpec:
    return StructuredSpec("choice", canonical_json(choices), **kw)


SPECS = {"json": json_spec(), "regex": regex_spec(), "choice": choice_spec()}
SMALL_SPECS = {"json": json_spec(SMALL), "regex": regex_spec(), "choice": choice_spec()}


def check_complete(spec: StructuredSpec, text: str) -> None:
    """`text` is a whole output the spec allows (raises AssertionError / jsonschema errors)."""
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(spec.text))
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif spec.kind == "regex":
        assert re.fullmatch(spec.text, text, flags=re.DOTALL), (spec.text, text)
    elif spec.kind == "choice":
        assert text in json.loads(spec.text), text
    else:
        raise AssertionError(f"no check for {spec.kind}")
