"""One chat choice's text as an assistant message: reasoning, content and tool calls, whole or
as streamed deltas, from one pipeline (`ReasoningStream`, then `ToolCallStream` on the answer).

The whole answer is the same pipeline fed the whole text, so streamed deltas concatenate to the
non-streamed message by construction: `delta.reasoning_content` pieces to `reasoning_content`,
`delta.content` to `content`, and per tool-call `index` one delta with `id`, `type` and the name,
then `arguments` fragments. With calls, a natural stop is `finish_reason: "tool_calls"` (the
legacy `functions` API answers with `function_call` and its first call only); a length cut keeps
`"length"`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.reasoning.parser import ReasoningFormat, ReasoningStream
from router.tools.stream import ToolCallStream, ToolEvent, ToolFormat


@dataclass(frozen=True)
class OutputSpec:
    """How a request's choices are read (built once per request; one `ChoiceOutput` per choice)."""

    reasoning: ReasoningFormat | None = None
    prompt_text: str = ""                  # the rendered prompt (where the thinking may have started)
    tools: ToolFormat | None = None        # None: no tool calls are read
    legacy_functions: bool = False

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None


@dataclass
class ChoiceOutput:
    """Turns one choice's text into OpenAI delta dicts (`feed`, `finish`) and a message (`message`)."""

    spec: OutputSpec
    reasoning_text: str = ""
    content_text: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    _reasoning: ReasoningStream | None = None
    _tools: ToolCallStream | None = None

    def __post_init__(self) -> None:
        if self.spec.reasoning is not None:
            self._reasoning = ReasoningStream(self.spec.reasoning, self.spec.prompt_text)
        if self.spec.tools is not None:
            self._tools = ToolCallStream(self.spec.tools)

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(text, final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas("", final=True)

    def _deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        answer = []
        if self._reasoning is not None:
            events = self._reasoning.feed(text) if text else []
            if final:
                events += self._reasoning.finish()
            for event in events:
                if event.kind == "reasoning":
                    self.reasoning_text += event.text
                    deltas.append({"reasoning_content": event.text})
                else:
                    answer.append(event.text)
        elif text:
            answer.append(text)
        answer_text = "".join(answer)
        if self._tools is None:
            if answer_text:
                self.content_text += answer_text
                deltas.append({"content": answer_text})
            return deltas
        events = self._tools.feed(answer_text) if answer_text else []
        if final:
            events += self._tools.finish()
        for event in events:
            delta = self._tool_delta(event)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _tool_delta(self, event: ToolEvent) -> dict[str, Any] | None:
        if event.kind == "content":
            self.content_text += event.text
            return {"content": event.text}
        legacy = self.spec.legacy_functions
        if legacy and event.index > 0:
            return None                    # the legacy API has one function call per message
        if event.kind == "open":
            self.calls.append({"id": event.call_id, "type": "function",
                               "function": {"name": event.name, "arguments": ""}})
            if legacy:
                return {"function_call": {"name": event.name, "arguments": ""}}
            return {"tool_calls": [{"index": event.index, "id": event.call_id, "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        self.calls[event.index]["function"]["arguments"] += event.text
        if legacy:
            return {"function_call": {"arguments": event.text}}
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}

    def finish_reason(self, reason: str) -> str:
        if self.calls and reason == "stop":
            return "function_call" if self.spec.legacy_functions else "tool_calls"
        return reason

    def message(self) -> dict[str, Any]:
        """The assistant message of everything fed so far (after `finish`)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content_text or None}
        if self.spec.reasoning is not None:
            message["reasoning_content"] = self.reasoning_text or None
        if self.calls:
            if self.spec.legacy_functions:
                message["function_call"] = self.calls[0]["function"]
            else:
                message["tool_calls"] = self.calls
        return message
