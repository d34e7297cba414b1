"""One choice's output text split into content and tool calls, as it streams.

`ToolCallStream.feed(text)` returns the events the new text makes certain, `finish()` the rest;
a whole (non-streamed) response is `feed(text) + finish()`. Each event depends only on the text,
never on how it was cut into pieces, which is what makes streamed deltas concatenate to exactly
the non-streamed message (streaming != non-streaming is the classic tool-calling bug, vLLM
#9693, #11392, #28806); tests feed fixed texts split at every position.

Text is held back only while it is undecided: a tail that could still become a call's start
marker, whitespace that is dropped if a call follows it (so a reply that is only calls has
`content: null`), and a call's text until its name is known. A call commits when its arguments
start; from then on every argument character that keeps the JSON valid is a fragment, and the
arguments are the model's own text of the JSON value (never re-serialized, so the fragments are
a prefix of them at every moment). Text that fails before a call commits is content, as written;
a committed call that fails (malformed arguments) ends where its valid prefix ends and the text
from there on is content again, so nothing the model wrote is lost and both answers agree. At
the end of the text, a call cut off before it committed is content if it is the only one, and
dropped after committed calls (it is a truncated repetition of their syntax); a call cut off
after it committed keeps its partial arguments, as OpenAI's `finish_reason: "length"` does.

A `ToolFormat` says where calls may appear: after a start marker anywhere in the text (hermes'
`<tool_call>`, mistral's `[TOOL_CALLS]`), or only at the start (llama3's bare JSON); and how
calls follow each other (an end marker, a separator, a JSON array).
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from router.tools.call_reader import CallReader
from router.tools.json_scan import DONE, DONE_BEFORE, INVALID, JsonScanner

_WS = " \t\n\r"
_ALNUM = string.ascii_letters + string.digits
MAX_NAME_CHARS = 256          # mistral v11 names are read until `[ARGS]`: bound the wait


class ToolEvent(NamedTuple):
    """`content` text, a call opening (`index`, `call_id`, `name`), or an `arguments` fragment."""

    kind: str                # "content" | "open" | "arguments"
    text: str = ""           # content text or arguments fragment
    index: int = -1
    call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class ToolFormat:
    """Where a model family writes its calls."""

    start_marker: str | None = None      # calls follow this marker, anywhere in the text
    start_prefix: str = ""               # anchored formats: an optional marker before the first call
    end_marker: str = ""                 # after each call (hermes' </tool_call>)
    separator: str = ""                  # between anchored calls (llama3's ";")
    array: bool = False                  # the calls are a JSON array after the marker / at the start
    name_args_marker: str = ""           # mistral v11 (`[TOOL_CALLS]name[ARGS]{...}`), when not an array
    id_length: int = 0                   # 0: OpenAI-style `call_<24>`; mistral: 9 alphanumerics
    name_keys: tuple[str, ...] = ("name",)
    args_keys: tuple[str, ...] = ("arguments", "parameters")


def random_call_id(length: int = 0) -> str:
    if length:
        return "".join(secrets.choice(_ALNUM) for _ in range(length))
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


# Modes. CONTENT: text, watching for the start marker. PLAIN: text to the end (anchored formats
# after their calls). START: anchored formats before the first non-space. The rest read calls.
(_CONTENT, _PLAIN, _START, _PREFIX, _CALL, _AFTER_CALL, _ARRAY_OPEN, _ARRAY_NEXT, _ARRAY_SEP, _NAME,
 _NAMED_ARGS) = range(11)


class ToolCallStream:
    """Splits one choice's text into content and calls (see the module note)."""

    def __init__(self, fmt: ToolFormat, new_id: Callable[[], str] | None = None) -> None:
        self.fmt = fmt
        self._new_id = new_id or (lambda: random_call_id(fmt.id_length))
        self._events: list[ToolEvent] = []
        self._fragments: list[str] = []     # argument characters not yet made into an event
        self._pending = ""          # CONTENT / START: text not yet decided
        self._held = ""             # call modes: text since the last committed point
        self._reader: CallReader | None = None
        self._scanner: JsonScanner | None = None
        self._match = ""            # the part of a marker (or a v11 name) read so far
        self._mode = _START if fmt.start_marker is None else _CONTENT
        self.num_calls = 0

    def feed(self, text: str) -> list[ToolEvent]:
        self._run(text)
        return self._take_events()

    def finish(self) -> list[ToolEvent]:
        """The end of the text: release what was held back (see the module note)."""
        mode, held = self._mode, self._held
        if mode in (_CONTENT, _START):
            if self._pending and not (self.num_calls and not self._pending.strip(_WS)):
                self._content(self._pending)
        elif held and not self._committed() and not self.num_calls:
            self._content(held)
        self._pending = self._held = ""
        return self._take_events()

    # -- the machine ----------------------------------------------------------------------------------

    def _run(self, text: str) -> None:
        i, n = 0, len(text)
        while i < n:
            mode = self._mode
            if mode == _CONTENT:
                i = self._scan_content(text, i)
            elif mode == _PLAIN:
                self._content(text[i:])
                return
            elif mode == _CALL and (end := self._reader.run(text, i)) > i:
                if not self._reader.opened:
                    self._held += text[i:end]
                i = end
            else:
                self._char(text[i])
                i += 1

    def _scan_content(self, text: str, i: int) -> int:
        """Content until the start marker; returns the index in `text` where it stopped."""
        marker = self.fmt.start_marker
        old = len(self._pending)
        pending = self._pending + text[i:]
        at = pending.find(marker)
        if at >= 0:
            self._pending = ""
            before = pending[:at]
            kept = before.rstrip(_WS)
            self._content(kept)
            self._held = before[len(kept):] + marker     # the whitespace is content if no call follows
            self._mode = _ARRAY_OPEN if self.fmt.array or self.fmt.name_args_marker else _CALL
            if self._mode == _CALL:
                self._new_reader()
            return i + at + len(marker) - old
        cut = len(pending) - marker_prefix_len(pending, marker)
        while cut > 0 and pending[cut - 1] in _WS:
            cut -= 1
        self._content(pending[:cut])
        self._pending = pending[cut:]
        return len(text)

    def _new_reader(self) -> None:
        self._reader = CallReader(self._open, self._arguments, self.fmt.name_keys, self.fmt.args_keys)
        self._mode = _CALL

    def _committed(self) -> bool:
        """The call being read has opened (its name and arguments are out)."""
        return (self._mode == _CALL and self._reader.opened) or self._mode == _NAMED_ARGS

    def _char(self, ch: str) -> None:
        mode, fmt = self._mode, self.fmt
        if mode == _START:
            if ch in _WS:
                self._pending += ch
                return
            self._held, self._pending = self._pending, ""
            if fmt.start_prefix and ch == fmt.start_prefix[0]:
                self._mode, self._match = _PREFIX, ""
            elif ch == ("[" if fmt.array else "{"):
                self._mode = _ARRAY_OPEN if fmt.array else _ARRAY_NEXT
            else:
                self._mode = _PLAIN
                self._content(self._held + ch)
                self._held = ""
                return
        if self._committed():
            self._committed_char(ch)
            return
        self._held += ch
        mode = self._mode
        if mode == _CALL:
            result = self._reader.feed(ch)
            if result == INVALID:
                self._fail(ch)
            elif result == DONE:
                self._call_done()
        elif mode == _PREFIX:
            self._match += ch
            if not fmt.start_prefix.startswith(self._match):
                self._fail(ch)
            elif self._match == fmt.start_prefix:
                self._mode = _ARRAY_OPEN if fmt.array else _ARRAY_NEXT
        elif mode == _ARRAY_OPEN:                   # after the marker: `[` (an array) or a v11 name
            if ch == "[" and fmt.array:
                self._mode = _ARRAY_NEXT
            elif ch not in _WS:
                if fmt.name_args_marker:
                    self._mode, self._match = _NAME, ""
                    self._name_char(ch)
                else:
                    self._fail(ch)
        elif mode == _ARRAY_NEXT:                   # a call must start here
            if ch == "{":
                self._new_reader()
                self._reader.feed(ch)
            elif ch not in _WS:
                self._fail(ch)
        elif mode == _ARRAY_SEP:
            if ch == ",":
                self._mode = _ARRAY_NEXT
            elif ch == "]":
                self._end_of_calls()
            elif ch not in _WS:
                self._fail(ch)
        elif mode == _AFTER_CALL:
            self._after_call_char(ch)
        else:                                       # _NAME
            self._name_char(ch)

    def _committed_char(self, ch: str) -> None:
        if self._mode == _CALL:
            result = self._reader.feed(ch)
            if result == INVALID:
                self._fail(ch)
            elif result == DONE:
                self._call_done()
            return
        scanner = self._scanner                     # _NAMED_ARGS
        if ch in _WS and not scanner.started:       # before the value
            return
        result = scanner.feed(ch)
        if result == INVALID:
            self._fail(ch)
        elif result == DONE_BEFORE:
            self._end_of_calls()
            self._run(ch)
        else:
            self._arguments(ch)
            if result == DONE:
                self._end_of_calls()

    def _call_done(self) -> None:
        self._held = ""
        fmt = self.fmt
        if fmt.array:
            self._mode = _ARRAY_SEP
        elif fmt.end_marker or fmt.separator:
            self._mode, self._match = _AFTER_CALL, ""
        else:
            self._end_of_calls()

    def _after_call_char(self, ch: str) -> None:
        """After a call: whitespace, then the end marker (hermes) or the separator (llama3)."""
        fmt = self.fmt
        if not self._match and ch in _WS:
            return
        if fmt.end_marker:
            self._match += ch
            if fmt.end_marker.startswith(self._match):
                if self._match == fmt.end_marker:
                    self._end_of_calls()
                return
        elif ch == fmt.separator:
            self._mode = _ARRAY_NEXT
            return
        # Not what follows a call here: the call stands, this text is content again.
        rest = self._held
        self._end_of_calls()
        self._run(rest)

    def _name_char(self, ch: str) -> None:
        """Mistral v11: the function name, up to `[ARGS]`."""
        marker = self.fmt.name_args_marker
        self._match += ch
        at = self._match.find(marker)
        if at < 0:
            name = self._match[: len(self._match) - marker_prefix_len(self._match, marker)]
            if len(self._match) > MAX_NAME_CHARS or not all(c.isalnum() or c in "_-." for c in name):
                self._fail(ch)
            return
        if at == 0:
            self._fail(ch)
            return
        self._open(self._match[:at])
        self._scanner, self._mode = JsonScanner(), _NAMED_ARGS

    # -- outcomes -------------------------------------------------------------------------------------

    def _open(self, name: str) -> None:
        self._event(ToolEvent("open", index=self.num_calls, call_id=self._new_id(), name=name))
        self.num_calls += 1
        self._held = ""

    def _arguments(self, fragment: str) -> None:
        self._fragments.append(fragment)     # joined into one event by _event / _take_events

    def _event(self, event: ToolEvent) -> None:
        self._flush_fragments()
        self._events.append(event)

    def _flush_fragments(self) -> None:
        if self._fragments:
            self._events.append(ToolEvent("arguments", "".join(self._fragments), index=self.num_calls - 1))
            self._fragments = []

    def _take_events(self) -> list[ToolEvent]:
        self._flush_fragments()
        events, self._events = self._events, []
        return _coalesce(events)

    def _end_of_calls(self) -> None:
        """Back to text: marker formats watch for more calls; anchored formats are done."""
        self._held = self._pending = ""
        self._mode = _CONTENT if self.fmt.start_marker is not None else _PLAIN

    def _fail(self, ch: str) -> None:
        """The text stopped being a call (see the module note)."""
        committed = self._committed()
        held = self._held
        self._end_of_calls()
        if committed:
            self._run(ch)
        else:
            self._content(held)

    def _content(self, text: str) -> None:
        if text:
            self._event(ToolEvent("content", text))


def marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (the tail to hold
    back: it may still become the marker)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _coalesce(events: list[ToolEvent]) -> list[ToolEvent]:
    """Adjacent content pieces, and adjacent fragments of one call, as one event each."""
    out: list[ToolEvent] = []
    for event in events:
        if out and event.kind != "open" and event.kind == out[-1].kind and event.index == out[-1].index:
            out[-1] = out[-1]._replace(text=out[-1].text + event.text)
        else:
            out.append(event)
    return out


