"""The Response object and its typed stream events (OpenAI's Responses API shapes).

One output item: an assistant message with one `output_text` part. A stream is
`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, then `response.output_text.delta` per pod message, then
`response.output_text.done`, `response.content_part.done`, `response.output_item.done` and
`response.completed` (or `response.incomplete` when `max_output_tokens` cut it short). Every
event carries `sequence_number` (0, 1, ...) and goes out as `event: <type>` + `data: <json>`;
there is no `[DONE]` (the Responses API ends with the stream). A failure after the stream began
is an `error` event.
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
        self.message_id = new_id("msg")
        self.created_at = created_at
        self.fields = fields
        self._sequence = 0

    # ------------------------------------------------------------------ objects
    def part(self, text: str, logprobs: list | None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    def message(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def response(self, status: str, output: list[dict[str, Any]],
                 usage_: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": incomplete, "output": output, "usage": usage_, **self.fields}

    def final(self, text: str, logprobs: list | None, finish_reason: str | None,
              usage_: dict[str, Any]) -> dict[str, Any]:
        """The finished response: `incomplete` when the token limit ended it."""
        status = "incomplete" if finish_reason == "length" else "completed"
        return self.response(status, [self.message(status, [self.part(text, logprobs)])], usage_)

    # ------------------------------------------------------------------ events
    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def head(self) -> str:
        started = self.response("in_progress", [])
        return (self.event("response.created", response=started)
                + self.event("response.in_progress", response=started)
                + self.event("response.output_item.added", output_index=0, item=self.message("in_progress", []))
                + self.event("response.content_part.added", item_id=self.message_id, output_index=0,
                             content_index=0, part=self.part("", None)))

    def delta(self, text: str, logprobs: list | None) -> str:
        return self.event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                          delta=text, logprobs=logprobs or [])

    def tail(self, response: dict[str, Any]) -> str:
        """The closing events of a finished response (`final`'s)."""
        item = response["output"][0]
        part = item["content"][0]
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return (self.event("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                           text=part["text"], logprobs=part["logprobs"])
                + self.event("response.content_part.done", item_id=self.message_id, output_index=0, content_index=0,
                             part=part)
                + self.event("response.output_item.done", output_index=0, item=item)
                + self.event(done, response=response))

    def error(self, exc: APIError) -> str:
        return self.event("error", code=exc.code, message=exc.message, param=exc.param)
