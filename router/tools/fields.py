"""OpenAI's tool-calling request fields as strict pydantic models (`router/protocol.py` declares
them on the chat body): `tools`, `tool_choice`, the legacy `functions` / `function_call`, and the
assistant `tool_calls` and `tool` messages of a conversation that already called tools."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
FunctionCallChoice = Literal["none", "auto"] | FunctionName     # legacy `function_call`


class FunctionCall(_Strict):
    """A call in the conversation: `arguments` is JSON text (some clients send the object itself)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(_Strict):
    """One entry of an assistant message's `tool_calls`."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
