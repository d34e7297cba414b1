"""OpenAI response bodies: completions and chat, whole and as SSE chunks, and usage (their logprobs:
`router.logprobs`).

A streamed chunk differs from the request's previous one only in its text, so `sse_template`
renders a chunk once per request with a hole for the text; filling it costs one `json.dumps` of a
string and gives exactly the bytes `sse(body)` would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wire import cbserve_pb2 as pb


@dataclass
class ChoiceResult:
    """Everything one choice produced, accumulated from its events (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: pb.PromptLogprobs | None = None


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


# Stands for the text in a body given to `sse_template` (NULs: never in a request id or model name).
TEXT = "\0text\0"


def sse_template(body: dict[str, Any]) -> Callable[[str], str]:
    """`fill(text)` == `sse(body)` with `text` where `body` holds TEXT."""
    prefix, suffix = sse(body).split(json.dumps(TEXT))
    dumps = json.dumps

    def fill(text: str) -> str:
        return prefix + dumps(text) + suffix

    return fill


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def completion_body(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
                    usage_: dict[str, int] | None) -> dict[str, Any]:
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    body["usage"] = usage_
    return body


def chat_body(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
              usage_: dict[str, int] | None, chunk: bool) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": created, "model": model, "choices": choices, "usage": usage_}
