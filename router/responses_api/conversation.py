"""A Responses request's `instructions`, `input` items and `tools` in the shapes chat uses, so the
conversation goes through the same chat template, tool checks and forcing grammars as chat.

Input items -> chat messages:
- `message` items (`role`, content as a string or text parts) -> that message;
- `function_call` items (`call_id`, `name`, `arguments`) -> a call on the assistant message just
  before (consecutive calls are one turn, as a chat template expects parallel calls), else on a
  new assistant message;
- `function_call_output` items (`call_id`, `output`) -> a `tool` message answering that call;
- `reasoning` items -> `reasoning_content` of the next assistant message (templates that render
  thinking, Qwen3's, see it; others drop it).
Anything else (images, files, item references, built-in tools' calls) is a 400 naming the item.

Tools: only `{"type": "function", "name", "description", "parameters", "strict"}` (the Responses
API's flat spelling of chat's `{"type": "function", "function": {...}}`); `tool_choice` is
`none` | `auto` | `required` | `{"type": "function", "name"}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.errors import bad_request
from router.protocol import MAX_CONTENT_PARTS, ChatMessage
from router.tools.fields import FunctionCall, FunctionDefinition, FunctionName, MessageToolCall, Tool

TEXT_PART_TYPES = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")
TOOL_CHOICES = ("none", "auto", "required")


def chat_messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """`instructions` (a system message first) and `input` as chat messages; 400s name the item."""
    out = [ChatMessage(role="system", content=instructions)] if instructions else []
    if isinstance(items, str):
        return out + [ChatMessage(role="user", content=items)]
    reasoning: list[str] = []          # reasoning items not yet given to an assistant message
    calls_open = False                 # the last message is an assistant turn that function calls may join
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{where}.role: must be one of {', '.join(ROLES)}", param="input")
            message = ChatMessage(role=role, content=_text(item.get("content"), f"{where}.content"))
            if role == "assistant" and reasoning:
                message.reasoning_content, reasoning = "".join(reasoning), []
            out.append(message)
            calls_open = role == "assistant"
        elif kind == "function_call":
            call = MessageToolCall(id=_string(item, "call_id", where),
                                   function=FunctionCall(name=_string(item, "name", where),
                                                         arguments=_string(item, "arguments", where)))
            if not calls_open:
                out.append(ChatMessage(role="assistant", content=None,
                                       reasoning_content="".join(reasoning) if reasoning else None))
                reasoning, calls_open = [], True
            out[-1].tool_calls = [*(out[-1].tool_calls or ()), call]
        elif kind == "function_call_output":
            out.append(ChatMessage(role="tool", tool_call_id=_string(item, "call_id", where),
                                   content=_text(item.get("output"), f"{where}.output")))
            calls_open = False
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []     # the text, else its summary
            reasoning.append(_text(parts, f"{where}.content"))
        else:
            raise bad_request(f"{where}: items of type {kind!r} are not supported (messages, function_call, "
                              f"function_call_output, reasoning)", param="input")
    return out


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key}: must be a string", param="input")
    return value


def _text(content: Any, where: str) -> str:
    """A string, or the text of a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of text parts", param="input")
    if len(content) > MAX_CONTENT_PARTS:
        raise bad_request(f"{where}: at most {MAX_CONTENT_PARTS} parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in (*TEXT_PART_TYPES, "reasoning_text", "summary_text") or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]: only text parts ({', '.join(TEXT_PART_TYPES)}) are supported, "
                              f"got {kind!r}", param="input")
        texts.append(part["text"])
    return "".join(texts)


@dataclass(frozen=True)
class ChatToolFields:
    """The tool fields of a chat body (what `router.tools.request.tool_request` reads)."""

    tools: list[Tool] | None
    tool_choice: str | FunctionName | None
    parallel_tool_calls: bool | None
    functions: None = None
    function_call: None = None


def chat_tool_fields(tools: list[dict[str, Any]] | None, tool_choice: Any,
                     parallel_tool_calls: bool | None) -> ChatToolFields:
    """The Responses API's flat function tools and tool choice in chat's shapes; 400s name the field."""
    chat_tools = None
    if tools is not None:
        chat_tools = []
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if tool.get("type") != "function":
                raise bad_request(f"{where}.type: only function tools are supported, got {tool.get('type')!r}",
                                  param=f"{where}.type")
            for key, kinds in (("name", str), ("description", (str, type(None))),
                               ("parameters", (dict, type(None))), ("strict", (bool, type(None)))):
                if not isinstance(tool.get(key), kinds):
                    raise bad_request(f"{where}.{key}: must be {_KIND_NAMES[key]}", param=f"{where}.{key}")
            chat_tools.append(Tool(type="function", function=FunctionDefinition(
                name=tool["name"], description=tool.get("description"), parameters=tool.get("parameters"),
                strict=tool.get("strict"))))
    choice = tool_choice
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
            raise bad_request('tool_choice: must be "none", "auto", "required" or {"type": "function", "name": ...}',
                              param="tool_choice")
        choice = FunctionName(name=tool_choice["name"])
    elif tool_choice is not None and tool_choice not in TOOL_CHOICES:
        raise bad_request(f"tool_choice: must be one of {', '.join(TOOL_CHOICES)} or a named function",
                          param="tool_choice")
    return ChatToolFields(chat_tools, choice, parallel_tool_calls)


_KIND_NAMES = {"name": "a string", "description": "a string", "parameters": "a JSON schema (an object)",
               "strict": "a boolean"}
