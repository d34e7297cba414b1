"""A `StructuredSpec` as llguidance's grammar text, and the check the router can run on it.

Torch-free and tokenizer-free, so the router validates exactly what the pods will compile: both
call `grammar_source`, the router then `validate_source` (syntax and limits, no tokenizer), the
pods `LLMatcher(tokenizer, source)` (`engine.grammar.llguidance_backend`).

Whitespace: with `any_whitespace` False (the default) JSON may hold, between its tokens, nothing,
one space, or one newline with up to 24 spaces/tabs of indentation: compact, `{"a": 1}` and
pretty-printed output all pass, but a model can never spend more than 25 characters of
whitespace in one gap, so it cannot run away in whitespace until `max_tokens` (the top failure
of unbounded JSON whitespace in vLLM's issues). With `any_whitespace` True, any run of JSON
whitespace is allowed (llguidance's flexible mode). A `lark` spec's `%json` parts take their
options from an `"x-guidance"` key inside each schema; `json_whitespace_options` is what to put
there for the same bound.
"""

from __future__ import annotations

import json

import llguidance

from engine.grammar.spec import StructuredSpec

BOUNDED_JSON_WHITESPACE = r"(\n[ \t]{0,24}|[ ]?)"
MAX_ERROR_CHARS = 600


def json_whitespace_options(any_whitespace: bool) -> dict:
    """llguidance's JSON options for the spec's whitespace rule (`x-guidance` / `defaults`)."""
    if any_whitespace:
        return {"whitespace_flexible": True}
    return {"whitespace_flexible": False, "whitespace_pattern": BOUNDED_JSON_WHITESPACE}


def grammar_source(spec: StructuredSpec) -> str:
    """The llguidance grammar (its JSON form) that constrains output to `spec`.

    Raises `ValueError` only for text that is not of its kind's form (a spec built through
    `StructuredSpec` already is); grammar errors show up in `validate_source` or at compile."""
    kind = spec.kind
    if kind in ("json_schema", "json_object"):
        schema = spec.text if kind == "json_schema" else '{"type":"object"}'
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults=json_whitespace_options(spec.any_whitespace))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if kind == "choice":
        # Each choice is a Lark string literal; JSON string escapes are Lark's.
        choices = json.loads(spec.text)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.text)
    raise ValueError(f"unknown structured output kind {kind!r}")


def validate_source(source: str) -> str | None:
    """None when `source` compiles (without a tokenizer), else a short error message."""
    error = llguidance.LLMatcher.validate_grammar(source)
    return short_error(error) if error else None


def short_error(message: str) -> str:
    """llguidance's error text without its state dump (which repeats the whole grammar)."""
    first = message.split("\n<state>", 1)[0].strip()
    return first if len(first) <= MAX_ERROR_CHARS else first[:MAX_ERROR_CHARS] + " ..."
