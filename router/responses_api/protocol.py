"""The body of `POST /v1/responses` (OpenAI's Responses API, stateless), and what it means here.

The sampling fields are the completions/chat ones (`_SamplingFields`: the same validation, vLLM's
extras included); the Responses API's own are `input` (a string, or message items whose content is
a string or text parts), `instructions` (a system message before them), `max_output_tokens`,
`top_logprobs` with `include: ["message.output_text.logprobs"]`, and `text.format` (`text`,
`json_object`, `json_schema`), which becomes the request's `StructuredSpec` for the pods.

Refused with a 400 naming the field, because answering would need what this server does not have:
`previous_response_id`, `store: true`, `conversation`, `background` (stored state), `tools` and
`tool_choice` other than none/auto (no tool-call parsing on this endpoint yet), non-text content
(images, files, audio), input items other than messages (function calls and their outputs,
reasoning, item references), `truncation: "auto"`. `reasoning` and unknown `include` entries ask
for output this server never produces and are ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import Field

from engine.grammar.spec import StructuredSpec, canonical_json
from engine.sampling_params import SamplingParams
from router.errors import bad_request
from router.protocol import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOLS, _capped, _SamplingFields, _Strict

LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_PART_TYPES = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Strict):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: str | None = None


class ResponsesRequest(_SamplingFields):
    """POST /v1/responses."""

    input: str | Annotated[list[dict[str, Any]], _capped(MAX_MESSAGES, min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = None
    top_logprobs: int | None = None
    include: Annotated[list[str], _capped(16)] | None = None
    text: TextConfig | None = None
    tools: Annotated[list[dict[str, Any]], _capped(MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    truncation: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def check_supported(self) -> None:
        """400 for what a stateless server without tool parsing cannot honour (module docstring)."""
        for name, value, why in (
                ("previous_response_id", self.previous_response_id, "send the whole conversation as input"),
                ("store", self.store, "send store=false or leave it out"),
                ("background", self.background, "background responses need stored state"),
                ("conversation", self.conversation, "send the whole conversation as input")):
            if value:
                raise bad_request(f"{name}: this server keeps no response state (stateless); {why}", param=name)
        if self.tools:
            raise bad_request("tools are not supported on /v1/responses yet", param="tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice: no tools are supported on /v1/responses yet", param="tool_choice")
        if self.truncation not in (None, "disabled"):
            raise bad_request("truncation: only 'disabled' is supported", param="truncation")
        if self.n != 1:
            raise bad_request("n: the Responses API has one output", param="n")
        if self.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs is not supported on /v1/responses", param="prompt_logprobs")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise bad_request("max_output_tokens: must be >= 1", param="max_output_tokens")

    def messages(self) -> list[dict[str, str]]:
        """`instructions` and `input` as chat-template messages; 400 naming the first item that is
        not a text message."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            kind = item.get("type", "message")
            if kind != "message":
                if kind in ("function_call", "function_call_output"):
                    raise bad_request(f"{where}: {kind} items need tool calling, not supported on /v1/responses "
                                      "yet", param="input")
                raise bad_request(f"{where}: items of type {kind!r} are not supported (only messages)", param="input")
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{where}.role: must be one of {', '.join(ROLES)}", param="input")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        return out

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.max_output_tokens if self.max_output_tokens is not None else default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.wants_logprobs else None
        params = self._sampling(max_tokens, logprobs)
        spec = self.structured_spec()
        return params if spec is None else dataclasses.replace(params, structured=spec)

    def structured_spec(self) -> StructuredSpec | None:
        """`text.format` as the pods' spec: a JSON schema (canonical text) or any JSON object."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredSpec(kind="json_object")
        if not fmt.schema_:
            raise bad_request("text.format.schema: a json_schema format needs a schema (a JSON object)",
                              param="text")
        return StructuredSpec(kind="json_schema", text=canonical_json(fmt.schema_))


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: must be a string or a list of text parts", param="input")
    if len(content) > MAX_CONTENT_PARTS:
        raise bad_request(f"{where}.content: at most {MAX_CONTENT_PARTS} parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}]: only text parts ({', '.join(TEXT_PART_TYPES)}) are supported, "
                              f"got {kind!r}", param="input")
        texts.append(part["text"])
    return "".join(texts)
