"""Reasoning models (`--reasoning-parser`): the thinking, between `<think>` and `</think>`, goes to
`reasoning_content`; what follows is the answer, where a grammar or a tool-call parser applies.

- `deepseek_r1`: the output starts inside the thinking (R1 often writes no `<think>`; its
  template may put one in the prompt), so without a `</think>` all of it is reasoning;
- `qwen3`: thinking only if the output opens with `<think>` (or the prompt left one open);
  otherwise all of it is the answer (`enable_thinking: false` renders an empty, closed think
  block into the prompt).

Either way the prompt's end decides first: a rendered prompt that ends in an open `<think>` means
the output starts in the thinking, one that ends with `</think>` means the thinking is over.
`ReasoningStream` applies the rule as text streams, holding back only a tail that could still
become a tag, so streamed and whole answers split at the same place. `after_token_ids` tells
the pods where a grammar starts: at the end of the thinking (`StructuredSpec.after_token_ids`),
unless the prompt already ended it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from router.tools.stream import marker_prefix_len

_WS = " \t\n\r"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_in_reasoning: bool      # with no tag in the prompt or at the output's start
    start_tag: str = "<think>"
    end_tag: str = "</think>"


REASONING_PARSERS = {f.name: f for f in (ReasoningFormat("deepseek_r1", True), ReasoningFormat("qwen3", False))}


class ReasoningEvent(NamedTuple):
    kind: str          # "reasoning" | "content"
    text: str


_OPENING, _REASONING, _CONTENT = range(3)


def initial_state(fmt: ReasoningFormat, prompt_text: str) -> str:
    """"reasoning", "content", or "opening" (decided by the output's first characters)."""
    tail = prompt_text.rstrip(_WS)
    if tail.endswith(fmt.end_tag):
        return "content"
    if tail.endswith(fmt.start_tag):
        return "reasoning"
    return "opening"


class ReasoningStream:
    """Splits one choice's text into reasoning and content as it streams (`feed`, then `finish`)."""

    def __init__(self, fmt: ReasoningFormat, prompt_text: str) -> None:
        self.fmt = fmt
        self._state = {"content": _CONTENT, "reasoning": _REASONING, "opening": _OPENING}[
            initial_state(fmt, prompt_text)]
        self._pending = ""

    @property
    def in_content(self) -> bool:
        return self._state == _CONTENT

    def feed(self, text: str) -> list[ReasoningEvent]:
        events: list[ReasoningEvent] = []
        if self._state == _CONTENT:
            if text:
                events.append(ReasoningEvent("content", text))
            return events
        pending = self._pending + text
        self._pending = ""
        if self._state == _OPENING:
            stripped = pending.lstrip(_WS)
            start = self.fmt.start_tag
            if len(stripped) < len(start) and start.startswith(stripped):
                self._pending = pending          # could still be the opening tag
                return events
            if stripped.startswith(start):
                pending = stripped[len(start):]
                self._state = _REASONING
            elif self.fmt.starts_in_reasoning:
                self._state = _REASONING
            else:
                self._state = _CONTENT
                events.append(ReasoningEvent("content", pending))
                return events
        end = self.fmt.end_tag
        at = pending.find(end)
        if at >= 0:
            if at:
                events.append(ReasoningEvent("reasoning", pending[:at]))
            self._state = _CONTENT
            rest = pending[at + len(end):]
            if rest:
                events.append(ReasoningEvent("content", rest))
            return events
        keep = marker_prefix_len(pending, end)
        if len(pending) > keep:
            events.append(ReasoningEvent("reasoning", pending[:len(pending) - keep]))
        self._pending = pending[len(pending) - keep:]
        return events

    def finish(self) -> list[ReasoningEvent]:
        pending, self._pending = self._pending, ""
        if not pending:
            return []
        if self._state == _OPENING and not self.fmt.starts_in_reasoning:
            return [ReasoningEvent("content", pending)]
        return [ReasoningEvent("reasoning", pending)]

