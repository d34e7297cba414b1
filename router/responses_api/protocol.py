"""The body of `POST /v1/responses` (OpenAI's Responses API, stateless), and what it means here.

The sampling fields are the completions/chat ones (`_SamplingFields`: the same validation, vLLM's
extras included); the Responses API's own are `input` (a string, or items: messages, function
calls and their outputs, reasoning; `conversation.py`), `instructions` (a system message before
them), `max_output_tokens`, `top_logprobs` with `include: ["message.output_text.logprobs"]`,
`text.format` (`text`, `json_object`, `json_schema`: the same constraint as chat's
`response_format`, validated and built by router/structured/), and function `tools` with
`tool_choice` and `parallel_tool_calls` (chat's tool machinery, router/tools/).

Refused with a 400 naming the field, because answering would need what this server does not have:
`previous_response_id`, `store: true`, `conversation`, `background` (stored state), non-function
tools (web search, file search, ...), non-text content (images, files, audio), item references,
`truncation: "auto"`. `reasoning` and unknown `include` entries are ignored (a reasoning parser,
when the router has one, decides whether reasoning items appear).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from engine.sampling.params import SamplingParams
from router.errors import bad_request
from router.protocol import MAX_MESSAGES, MAX_TOOLS, ChatMessage, _capped, _SamplingFields, _Strict
from router.responses_api.conversation import ChatToolFields, chat_messages, chat_tool_fields
from router.structured.surface import Constraint

LOGPROBS_INCLUDE = "message.output_text.logprobs"


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
        """400 for what a stateless server cannot honour (module docstring)."""
        for name, value, why in (
                ("previous_response_id", self.previous_response_id, "send the whole conversation as input"),
                ("store", self.store, "send store=false or leave it out"),
                ("background", self.background, "background responses need stored state"),
                ("conversation", self.conversation, "send the whole conversation as input")):
            if value:
                raise bad_request(f"{name}: this server keeps no response state (stateless); {why}", param=name)
        if self.truncation not in (None, "disabled"):
            raise bad_request("truncation: only 'disabled' is supported", param="truncation")
        if self.n != 1:
            raise bad_request("n: the Responses API has one output", param="n")
        if self.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs is not supported on /v1/responses", param="prompt_logprobs")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise bad_request("max_output_tokens: must be >= 1", param="max_output_tokens")

    def messages(self) -> list[ChatMessage]:
        """`instructions` and `input` as chat messages (`conversation.chat_messages`)."""
        return chat_messages(self.instructions, self.input)

    @property
    def asks_for_tools(self) -> bool:
        return self.tools is not None or self.tool_choice is not None

    def tool_fields(self) -> ChatToolFields:
        """`tools` and `tool_choice` as chat's fields (`router.tools.request.tool_request` reads them)."""
        return chat_tool_fields(self.tools, self.tool_choice, self.parallel_tool_calls)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.max_output_tokens if self.max_output_tokens is not None else default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.wants_logprobs else None
        return self._sampling(max_tokens, logprobs)

    def constraint(self) -> Constraint | None:
        """`text.format` as the constraint chat's `response_format` would be (router/structured/)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Constraint("json_object", None, "text.format")
        if not fmt.schema_:
            raise bad_request("text.format.schema: a json_schema format needs a schema (a JSON object)",
                              param="text.format.schema")
        return Constraint("json_schema", fmt.schema_, "text.format.schema")
