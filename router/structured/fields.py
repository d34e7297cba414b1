"""The request fields that constrain a response, as strict pydantic models (`router/protocol.py`
declares them on both endpoints).

Three surfaces say the same thing: OpenAI's `response_format`, vLLM's `structured_outputs`
object, and the older `guided_*` fields vLLM removed in 0.12 (old clients still send them, and a
server that ignores them answers 200 with unconstrained text). Every one is honoured or refused;
none is ignored. `structured_outputs` refuses keys it does not know (`extra="forbid"`), because a
typo or a newer option there would otherwise turn a constraint off silently.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 1024       # `choice` / `guided_choice` entries


def _choices() -> Any:
    return Field(min_length=1, max_length=MAX_CHOICES, fail_fast=True)


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's `{name, description?, schema?, strict?}`."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None     # always enforced here: the grammar holds the output to the schema


class ResponseFormat(BaseModel):
    """`response_format`: `text`, `json_object`, or `json_schema` (vLLM's `structural_tag` is refused)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extension: one of `json`, `regex`, `choice`, `grammar`,
    `json_object`, plus options."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], _choices()] | None = None
    grammar: str | None = None                  # Lark or GBNF (GBNF is converted to Lark here)
    json_object: bool | None = None
    # None: JSON whitespace is bounded (the default here, unlike vLLM); False asks for any.
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False
    disable_fallback: bool = False              # there is no fallback backend: always true here
    whitespace_pattern: str | None = None       # refused: not expressible in the spec
    structural_tag: str | None = None           # refused


class GuidedFields(BaseModel):
    """The pre-0.12 vLLM names, mixed into both request bodies."""

    model_config = ConfigDict(strict=True, extra="ignore")

    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], _choices()] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None    # refused (see StructuredOutputs.whitespace_pattern)
    guided_decoding_backend: str | None = None      # only llguidance's names are accepted
