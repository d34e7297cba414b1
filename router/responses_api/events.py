"""The Response object, its output items and its typed stream events (OpenAI's Responses API shapes).

A response's output is built from one choice's deltas (`router.chat_output.ChoiceOutput`'s dicts:
`content`, `reasoning_content`, a tool call opening, its argument fragments) by `OutputItems`, the
same for the whole answer and the stream, so the streamed items are the final ones by construction:
- text -> a `message` item with one `output_text` part: `response.output_item.added`,
  `response.content_part.added`, `response.output_text.delta`..., then `response.output_text.done`,
  `response.content_part.done`, `response.output_item.done`;
- reasoning -> a `reasoning` item with one `reasoning_text` part, the same events with
  `response.reasoning_text.delta` / `.done`;
- a tool call -> a `function_call` item (`call_id`, `name`, `arguments`):
  `response.output_item.added`, `response.function_call_arguments.delta`..., `.done`,
  `response.output_item.done`.
Items follow each other in the text's order (an item closes when the next kind starts). A stream
opens with `response.created` and `response.in_progress` and ends with `response.completed` (or
`response.incomplete` when `max_output_tokens` cut it short). Every event carries
`sequence_number` (0, 1, ...) and goes out as `event: <type>` + `data: <json>`; there is no
`[DONE]` (the Responses API ends with the stream). A failure after the stream began is an `error`
event.

Logprobs (when asked for) go on the message text they came with: a pod message's entries are
attached to the next `output_text.delta` (those of tokens that became a call or reasoning go with
the text after it; after the last text, there is none to carry them).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from router.errors import APIError


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(num_input: int, num_cached: int, num_output: int) -> dict[str, Any]:
    return {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": num_cached, "cache_write_tokens": 0},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_input + num_output}


class ResponseBuilder:
    """One response's object at each stage, and its events in order (`sequence_number`)."""

    def __init__(self, response_id: str, created_at: int, fields: dict[str, Any]) -> None:
        """`fields`: what the response repeats from the request (model, instructions, sampling, ...)."""
        self.response_id = response_id
        self.created_at = created_at
        self.fields = fields
        self._sequence = 0

    def response(self, status: str, output: list[dict[str, Any]],
                 usage_: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": incomplete, "output": output, "usage": usage_, **self.fields}

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def head(self) -> str:
        started = self.response("in_progress", [])
        return self.event("response.created", response=started) + self.event("response.in_progress", response=started)

    def tail(self, response: dict[str, Any]) -> str:
        """The closing event of a finished response."""
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self.event(done, response=response)

    def error(self, exc: APIError) -> str:
        return self.event("error", code=exc.code, message=exc.message, param=exc.param)


# The two item kinds with one text part: (item type, part type, the text events' prefix).
_TEXT_ITEMS = {"content": ("message", "output_text", "response.output_text"),
               "reasoning_content": ("reasoning", "reasoning_text", "response.reasoning_text")}


class OutputItems:
    """A response's output items, built from one choice's deltas, with the events that build them
    (see the module note). `add` and `close` return the events' text."""

    def __init__(self, builder: ResponseBuilder, logprobs: bool) -> None:
        self.builder = builder
        self.items: list[dict[str, Any]] = []
        self._open: str | None = None       # the open item's delta key: content | reasoning_content | tool_calls
        self._text: list[str] = []
        self._logprobs = [] if logprobs else None   # entries for the open message's part
        self._pending: list = []            # entries not yet attached to a delta

    def add(self, delta: dict[str, Any], logprobs: list | None = None) -> str:
        """One delta (and the entries of the pod message it came from, attached to the next text)."""
        self._pending.extend(logprobs or ())
        events = []
        for key in ("reasoning_content", "content"):
            if key in delta:
                events.append(self._text_delta(key, delta[key]))
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                events.append(self._close() + self._open_call(call))
            else:
                events.append(self._arguments(call["function"]["arguments"]))
        return "".join(events)

    def close(self, status: str = "completed") -> str:
        """The end of the output: the open item closes with `status` (`incomplete` when the token
        limit cut it); an output with no item is an empty message."""
        events = ""
        if not self.items or (self._pending and self._open == "content"):
            events = self._text_delta("content", "")      # the last entries, or an empty answer
        return events + self._close(status)

    @property
    def index(self) -> int:
        return len(self.items) - 1

    def _text_delta(self, key: str, text: str) -> str:
        events = ""
        if self._open != key:
            events = self._close() + self._open_text(key)
        self._text.append(text)
        b = self.builder
        item = self.items[-1]
        if key == "content":
            entries, self._pending = self._pending, []
            if self._logprobs is not None:
                self._logprobs.extend(entries)
            return events + b.event("response.output_text.delta", item_id=item["id"], output_index=self.index,
                                    content_index=0, delta=text, logprobs=entries)
        return events + b.event("response.reasoning_text.delta", item_id=item["id"], output_index=self.index,
                                content_index=0, delta=text)

    def _open_text(self, key: str) -> str:
        kind, part_kind, _ = _TEXT_ITEMS[key]
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
        self.items.append(item)
        self._open, self._text = key, []
        b = self.builder
        return (b.event("response.output_item.added", output_index=self.index, item=dict(item, content=[]))
                + b.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                          content_index=0, part=_part(part_kind, "", [] if kind == "message" else None)))

    def _open_call(self, call: dict[str, Any]) -> str:
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": ""}
        self.items.append(item)
        self._open = "tool_calls"
        return self.builder.event("response.output_item.added", output_index=self.index, item=dict(item))

    def _arguments(self, fragment: str) -> str:
        item = self.items[-1]
        item["arguments"] += fragment
        return self.builder.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.index, delta=fragment)

    def _close(self, status: str = "completed") -> str:
        key, self._open = self._open, None
        if key is None:
            return ""
        b, item, index = self.builder, self.items[-1], self.index
        item["status"] = status
        if key == "tool_calls":
            return (b.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"])
                    + b.event("response.output_item.done", output_index=index, item=item))
        kind, part_kind, prefix = _TEXT_ITEMS[key]
        text = "".join(self._text)
        logprobs = None
        if kind == "message":
            logprobs = self._logprobs or []
            if self._logprobs is not None:
                self._logprobs = []
        part = _part(part_kind, text, logprobs)
        item["content"] = [part]
        done = {"text": text, **({"logprobs": logprobs} if kind == "message" else {})}
        return (b.event(f"{prefix}.done", item_id=item["id"], output_index=index, content_index=0, **done)
                + b.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part)
                + b.event("response.output_item.done", output_index=index, item=item))


def _part(kind: str, text: str, logprobs: list | None) -> dict[str, Any]:
    if kind == "output_text":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": kind, "text": text}
