"""Conversation messages as chat templates expect them (Hugging Face's convention, vLLM's
`_postprocess_messages`): an assistant's `tool_calls` carry `arguments` as a dict, not JSON text;
`tool` results keep `tool_call_id` (and `name`); the legacy `function_call` and `function` role
become a tool call and a `tool` message. An assistant's `reasoning_content` is passed on for
templates that render it (Qwen3's)."""

from __future__ import annotations

import json
from typing import Any

from router.tools.fields import FunctionCall


def _arguments(call: FunctionCall) -> Any:
    """The arguments as a dict where they are JSON text of an object (else as sent)."""
    if not isinstance(call.arguments, str):
        return call.arguments
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def template_message(message: Any) -> dict[str, Any]:
    """One `ChatMessage` as a template dict."""
    role = "tool" if message.role == "function" else message.role
    item: dict[str, Any] = {"role": role, "content": message.text()}
    if message.name is not None:
        item["name"] = message.name
    calls = list(message.tool_calls or ())
    if message.function_call is not None:
        calls.append(message.function_call)
    if calls:
        item["tool_calls"] = [
            {"id": getattr(call, "id", None), "type": "function",
             "function": {"name": fn.name, "arguments": _arguments(fn)}}
            for call, fn in ((c, getattr(c, "function", c)) for c in calls)]
        if message.content is None:
            item["content"] = None
    if message.tool_call_id is not None:
        item["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        item["reasoning_content"] = message.reasoning_content
    return item
