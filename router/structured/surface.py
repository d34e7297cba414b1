"""Which output constraint a request asks for, read from whichever surface it used.

`requested_constraint` looks at `response_format`, `structured_outputs` and the `guided_*`
fields and returns at most one `Constraint`: the kind, the client's value, and the parameter it
came from (so every later error names what the client wrote). Two kinds in one request is a
400, as in vLLM: there is no sensible intersection of a regex and a schema. Options that the
spec cannot carry (a whitespace pattern, another backend, structural tags) are a 400 naming
them, never dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from router.errors import bad_request
from router.structured.fields import GuidedFields, ResponseFormat, StructuredOutputs

# `guided_decoding_backend` values that mean the backend the pods run.
ACCEPTED_BACKENDS = ("auto", "guidance", "llguidance")


@dataclass(frozen=True)
class Constraint:
    """One request's constraint as the client wrote it (before canonicalization and validation)."""

    kind: str                    # json_schema | json_object | regex | choice | grammar
    value: Any                   # schema dict, pattern, list of choices, grammar text; None for json_object
    param: str                   # the field it came from, e.g. "response_format.json_schema.schema"
    any_whitespace: bool = False
    disable_additional_properties: bool = False


def _schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    """vLLM takes a schema as an object or as its JSON text."""
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except ValueError as exc:
        raise bad_request(f"{param}: not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param}: a JSON schema must be an object", param=param)
    return schema


def _from_response_format(fmt: ResponseFormat) -> Constraint | None:
    if fmt.type == "text":
        return None
    if fmt.type == "structural_tag":
        raise bad_request("response_format.type 'structural_tag' is not supported; use json_schema, or "
                          "structured_outputs.grammar", param="response_format.type")
    if fmt.type == "json_object":
        return Constraint("json_object", None, "response_format")
    if fmt.json_schema is None:
        raise bad_request("response_format.json_schema is required when type is 'json_schema'",
                          param="response_format.json_schema")
    if fmt.json_schema.schema_ is None:      # OpenAI allows it: any JSON object then
        return Constraint("json_object", None, "response_format.json_schema")
    return Constraint("json_schema", fmt.json_schema.schema_, "response_format.json_schema.schema")


def _from_structured_outputs(so: StructuredOutputs) -> list[Constraint]:
    p = "structured_outputs"
    for name in ("whitespace_pattern", "structural_tag"):
        if getattr(so, name) is not None:
            raise bad_request(f"{p}.{name} is not supported", param=f"{p}.{name}")
    any_ws = so.disable_any_whitespace is False
    found = []
    if so.json_ is not None:
        found.append(Constraint("json_schema", _schema(so.json_, f"{p}.json"), f"{p}.json", any_ws,
                                so.disable_additional_properties))
    if so.regex is not None:
        found.append(Constraint("regex", so.regex, f"{p}.regex"))
    if so.choice is not None:
        found.append(Constraint("choice", so.choice, f"{p}.choice"))
    if so.grammar is not None:
        found.append(Constraint("grammar", so.grammar, f"{p}.grammar"))
    if so.json_object:
        found.append(Constraint("json_object", None, f"{p}.json_object", any_ws))
    if not found:
        raise bad_request(f"{p} must set one of json, regex, choice, grammar, json_object", param=p)
    return found


def _from_guided(fields: GuidedFields) -> list[Constraint]:
    if fields.guided_whitespace_pattern is not None:
        raise bad_request("guided_whitespace_pattern is not supported (JSON whitespace is bounded by default; "
                          "structured_outputs.disable_any_whitespace=false allows any)",
                          param="guided_whitespace_pattern")
    backend = fields.guided_decoding_backend
    if backend is not None and backend not in ACCEPTED_BACKENDS:
        raise bad_request(f"guided_decoding_backend {backend!r} is not available; this server runs llguidance "
                          f"(accepted: {', '.join(ACCEPTED_BACKENDS)})", param="guided_decoding_backend")
    found = []
    if fields.guided_json is not None:
        found.append(Constraint("json_schema", _schema(fields.guided_json, "guided_json"), "guided_json"))
    if fields.guided_regex is not None:
        found.append(Constraint("regex", fields.guided_regex, "guided_regex"))
    if fields.guided_choice is not None:
        found.append(Constraint("choice", fields.guided_choice, "guided_choice"))
    if fields.guided_grammar is not None:
        found.append(Constraint("grammar", fields.guided_grammar, "guided_grammar"))
    return found


def requested_constraint(request: Any) -> Constraint | None:
    """The one constraint `request` asks for, or None; a 400 for two, or for an unsupported option.

    `request` is a chat or completions body (both carry the three surfaces)."""
    found = []
    if request.response_format is not None:
        constraint = _from_response_format(request.response_format)
        if constraint is not None:
            found.append(constraint)
    if request.structured_outputs is not None:
        found += _from_structured_outputs(request.structured_outputs)
    found += _from_guided(request)
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise bad_request(f"only one output constraint per request; got {names}", param=found[1].param)
    return found[0] if found else None
