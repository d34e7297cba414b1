"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), as strict pydantic models.

Strict: a string where a number belongs is a 400, not a silent coercion (pydantic's strict mode still
takes an integer for a float, as JSON does). Unknown fields are ignored, as OpenAI and vLLM do, so
clients that send `user` or newer fields keep working. Ranges are checked by
`engine.sampling.params.SamplingParams`, the same code the pods run, so router and pods agree.

Every list has a cap checked while it is parsed, and stops at its first bad item (`fail_fast`): a
16 MiB body of a million tiny lists is refused after 65 of them, not after building a million
Python objects and a million error records (which took the router tens of seconds).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling.params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from router.structured.fields import GuidedFields, ResponseFormat, StructuredOutputs
from router.tools.fields import FunctionCall, FunctionCallChoice, FunctionDefinition, MessageToolCall, Tool, ToolChoice
from router.tools.messages import template_message

MAX_N = 16
MAX_PROMPTS = 64                  # prompts in one /v1/completions batch
MAX_PROMPT_TOKEN_IDS = 1 << 20    # ids in one prompt; the context length is checked after parsing
MAX_LOGIT_BIAS = 300              # entries (OpenAI's limit); any is refused as unsupported anyway
MAX_MESSAGES = 4096               # chat messages; each costs template tokens, so few fit a context
MAX_CONTENT_PARTS = 256           # text parts in one message
MAX_TOOLS = 1024                  # parse-time cap; --max-tools (default 128, OpenAI's) is the limit
MAX_TOOL_CALLS = 128              # calls in one assistant message


def _capped(max_length: int, min_length: int | None = None) -> Any:
    """A list field of at most `max_length` items that stops at its first invalid item."""
    return Field(min_length=min_length, max_length=max_length, fail_fast=True)


TokenIds = Annotated[list[int], _capped(MAX_PROMPT_TOKEN_IDS)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(GuidedFields, _Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | Annotated[list[str], _capped(MAX_STOP_STRINGS)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    # vLLM's extra sampling fields (load generators send them).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Annotated[list[int], _capped(MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(default=0, ge=-(1 << 31), le=(1 << 31) - 1)   # int32 on the wire
    # Output constraints (router/structured/): OpenAI's, vLLM's, and vLLM's older `guided_*` (GuidedFields).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: int | None = None          # vLLM: score the prompt (router/logprobs.py)
    return_tokens_as_token_ids: bool = False    # vLLM: tokens spelled `token_id:N` in logprobs

    def _sampling(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams for this body; raises SamplingParamsError naming the bad field."""
        values: dict[str, Any] = {
            "max_tokens": max_tokens, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "stop": tuple([self.stop] if isinstance(self.stop, str) else self.stop or ()),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "seed": self.seed,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return SamplingParams(**values)

    def wants_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: (str | Annotated[list[str], _capped(MAX_PROMPTS)] | TokenIds
             | Annotated[list[TokenIds], _capped(MAX_PROMPTS)])
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        if self.scores_only:
            max_tokens = 1    # one token is sampled and not shown (vLLM does the same)
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:   # the echoed prompt shows its logprobs too
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        return self._sampling(max_tokens, self.logprobs, prompt_logprobs)

    @property
    def scores_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt back (with its logprobs), nothing generated."""
        return self.echo and self.max_tokens == 0


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | Annotated[list[TextPart], _capped(MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall], _capped(MAX_TOOL_CALLS)] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None      # legacy
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], _capped(MAX_MESSAGES, min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Annotated[list[Tool], _capped(MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[list[FunctionDefinition], _capped(MAX_TOOLS)] | None = None   # legacy tools
    function_call: FunctionCallChoice | None = None                                     # legacy tool_choice
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None    # vLLM's: e.g. {"enable_thinking": false}

    def requested_max_tokens(self) -> int | None:
        # `max_completion_tokens` is the newer name; it wins when both are sent.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        requested = self.requested_max_tokens()
        max_tokens = requested if requested is not None else default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs, self.prompt_logprobs)

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template (text parts joined; router/tools/messages.py)."""
        return [template_message(message) for message in self.messages]
