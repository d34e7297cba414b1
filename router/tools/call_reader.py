"""Reading one tool call, `{"name": ..., "arguments": {...}}`, a character at a time.

The reader knows the object's top level (keys, colons, commas) and hands each member's value to
a `JsonScanner`, so it can say, at every character, whether the text is still a call and which
characters belong to the arguments. The parser streams those characters as they come: the call
opens (its name is known) when its arguments start, and every later character of the arguments
is an argument fragment. Arguments written before the name are kept until the name arrives.
A call whose object closes without arguments has arguments `{}` (vLLM #28806: streaming once
dropped them for parameterless tools).
"""

from __future__ import annotations

import json

from router.tools.json_scan import CONTINUE, DONE, DONE_BEFORE, INVALID, JsonScanner

_WS = " \t\n\r"
# Where the reader is in the object.
_OPEN, _KEY_OR_END, _KEY, _IN_KEY, _COLON, _VALUE_START, _IN_VALUE, _COMMA_OR_END, _CLOSED = range(9)


class CallReader:
    """One call object. `feed(ch)` returns CONTINUE, DONE (the object closed) or INVALID; events
    go to `on_open(name)` and `on_arguments(fragment)` as they become certain."""

    __slots__ = ("_name_keys", "_args_keys", "_on_open", "_on_arguments", "_state", "_scanner", "_key_text",
                 "_role", "name", "opened", "_early_args", "_value_text", "_seen_args")

    def __init__(self, on_open, on_arguments, name_keys=("name",), args_keys=("arguments", "parameters")) -> None:
        self._name_keys, self._args_keys = name_keys, args_keys
        self._on_open, self._on_arguments = on_open, on_arguments
        self._state = _OPEN
        self._scanner: JsonScanner | None = None
        self._key_text = ""
        self._role = ""            # of the value being read: "name", "args" or "" (ignored)
        self.name: str | None = None
        self.opened = False        # on_open has been called: the call is committed
        self._early_args = ""      # arguments read before the name
        self._value_text = ""      # the name's JSON text while it is read
        self._seen_args = False

    def feed(self, ch: str) -> int:
        state = self._state
        if state == _IN_VALUE:
            return self._value(ch)
        if state == _IN_KEY:
            result = self._scanner.feed(ch)
            self._key_text += ch
            if result == INVALID:
                return INVALID
            if result == DONE:
                self._state = _COLON
            return CONTINUE
        if ch in _WS:
            return INVALID if state == _CLOSED else CONTINUE
        if state == _OPEN:
            if ch != "{":
                return INVALID
            self._state = _KEY_OR_END
            return CONTINUE
        if state in (_KEY_OR_END, _KEY):
            if ch == '"':
                self._scanner, self._key_text, self._state = JsonScanner(), ch, _IN_KEY
                self._scanner.feed(ch)
                return CONTINUE
            if ch == "}" and state == _KEY_OR_END:
                return self._close()
            return INVALID
        if state == _COLON:
            if ch != ":":
                return INVALID
            self._state = _VALUE_START
            return CONTINUE
        if state == _VALUE_START:
            return self._start_value(ch)
        if state == _COMMA_OR_END:
            if ch == ",":
                self._state = _KEY
                return CONTINUE
            if ch == "}":
                return self._close()
        return INVALID

    def _start_value(self, ch: str) -> int:
        key = json.loads(self._key_text)
        if key in self._name_keys and self.name is None:
            self._role = "name"
        elif key in self._args_keys and not self._seen_args:
            self._role, self._seen_args = "args", True
            if self.name is not None:        # the usual order: the call opens as its arguments start
                self._open()
        else:
            self._role = ""
        self._scanner, self._value_text, self._state = JsonScanner(), "", _IN_VALUE
        return self._value(ch)

    def run(self, text: str, start: int) -> int:
        """Take the run of plain string characters of a value from `text[start]` in one step
        (the common case inside arguments); returns where it ends (`start`: nothing taken)."""
        if self._state != _IN_VALUE:
            return start
        end = self._scanner.string_run(text, start)
        if end > start:
            self._take(text[start:end])
        return end

    def _take(self, chars: str) -> None:
        if self._role == "args":
            if self.opened:
                self._on_arguments(chars)
            else:
                self._early_args += chars
        elif self._role == "name":
            self._value_text += chars

    def _value(self, ch: str) -> int:
        result = self._scanner.feed(ch)
        if result == INVALID:
            return INVALID
        consumed = result != DONE_BEFORE
        if consumed:
            self._take(ch)
        if result == CONTINUE:
            return CONTINUE
        self._state = _COMMA_OR_END          # the value is complete
        if self._role == "name":
            name = json.loads(self._value_text)
            if not isinstance(name, str) or not name:
                return INVALID
            self.name = name
            if self._seen_args:              # arguments came first: open now with them
                self._open()
        return CONTINUE if consumed else self.feed(ch)

    def _open(self) -> None:
        self.opened = True
        self._on_open(self.name)
        if self._early_args:
            self._on_arguments(self._early_args)
            self._early_args = ""

    def _close(self) -> int:
        self._state = _CLOSED
        if self.name is None:
            return INVALID
        if not self.opened:
            self._open()
            if not self._seen_args:
                self._on_arguments("{}")
        return DONE
