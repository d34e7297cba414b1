"""An incremental JSON validator: characters in, one at a time, "still a valid prefix" out.

Tool-call parsers stream a call's arguments while the model writes them, so they must know, at
every character, whether the text so far can still be the start of a JSON value and where that
value ends, without waiting for the end of the output. `JsonScanner` is a pushdown automaton
over RFC 8259 (objects, arrays, strings with escapes, numbers, literals) that answers exactly
that; it never builds the value. Whitespace before the value is the caller's business.
"""

from __future__ import annotations

import re

CONTINUE = 0      # consumed; the value is not finished
DONE = 1          # consumed; this character finished the value
DONE_BEFORE = 2   # NOT consumed: the value (a number) ended just before this character
INVALID = 3       # no JSON value starts with the text so far plus this character

_WS = " \t\n\r"
_HEX = set("0123456789abcdefABCDEF")
_DIGITS = set("0123456789")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_ESCAPES = set('"\\/bfnrtu')
_PLAIN_RUN = re.compile(r'[^"\\\x00-\x1f]*')      # string characters that change no state

# Value-level states on the stack of open containers.
_OBJ_KEY_OR_END, _OBJ_KEY, _OBJ_COLON, _OBJ_VALUE, _OBJ_COMMA_OR_END = range(5)
_ARR_VALUE_OR_END, _ARR_VALUE, _ARR_COMMA_OR_END = range(5, 8)
# Number sub-states: after '-', after a leading 0, in int digits, after '.', in fraction,
# after 'e', after the exponent sign, in exponent digits.
_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(8)
_NUMBER_CAN_END = (_N_ZERO, _N_INT, _N_FRAC, _N_EXP)


class JsonScanner:
    """Validates one JSON value incrementally; `feed(ch)` returns CONTINUE, DONE, DONE_BEFORE or INVALID."""

    __slots__ = ("_stack", "_scalar", "_sub", "_literal", "_hex_left", "_started", "_finished")

    def __init__(self) -> None:
        self._stack: list[int] = []   # open containers, innermost last
        self._scalar = ""             # "", "string", "number", "literal"
        self._sub = 0                 # number sub-state, or 1 after a backslash in a string
        self._literal = ""            # the rest of a literal still to come
        self._hex_left = 0            # hex digits still to come in a \\u escape
        self._started = False
        self._finished = False

    @property
    def started(self) -> bool:
        """A first character has been read."""
        return self._started

    @property
    def finished(self) -> bool:
        return self._finished

    def string_run(self, text: str, start: int) -> int:
        """Inside a string: where the run of plain characters (no quote, backslash or control
        character) from `text[start]` ends. They change no state, so a caller may take them all
        as consumed at once; elsewhere returns `start`."""
        if self._scalar != "string" or self._sub or self._hex_left:
            return start
        return _PLAIN_RUN.match(text, start).end()

    def can_end(self) -> bool:
        """The text so far is a whole value (a number may end here: at the end of the output)."""
        return self._finished or (self._scalar == "number" and not self._stack and self._sub in _NUMBER_CAN_END)

    def feed(self, ch: str) -> int:
        if self._finished:
            return INVALID
        if self._scalar == "string":
            return self._string(ch)
        if self._scalar == "number":
            return self._number(ch)
        if self._scalar == "literal":
            if ch != self._literal[0]:
                return INVALID
            self._literal = self._literal[1:]
            if not self._literal:
                self._scalar = ""
                return self._value_done()
            return CONTINUE
        return self._structure(ch)

    # -- scalars --------------------------------------------------------------------------------------

    def _string(self, ch: str) -> int:
        if self._hex_left:
            if ch not in _HEX:
                return INVALID
            self._hex_left -= 1
            return CONTINUE
        if self._sub:                      # after a backslash
            if ch not in _ESCAPES:
                return INVALID
            self._sub = 0
            if ch == "u":
                self._hex_left = 4
            return CONTINUE
        if ch == "\\":
            self._sub = 1
            return CONTINUE
        if ch == '"':
            self._scalar = ""
            stack = self._stack
            if stack and stack[-1] == _OBJ_KEY:          # a key, not a value
                stack[-1] = _OBJ_COLON
                return CONTINUE
            return self._value_done()
        return INVALID if ch < " " else CONTINUE         # control characters must be escaped

    def _number(self, ch: str) -> int:
        sub = self._sub
        digit = ch in _DIGITS
        if sub == _N_MINUS:
            nxt = _N_ZERO if ch == "0" else _N_INT if digit else -1
        elif sub in (_N_ZERO, _N_INT):
            if digit:
                nxt = _N_INT if sub == _N_INT else -1     # no leading zeros
            elif ch == ".":
                nxt = _N_DOT
            elif ch in "eE":
                nxt = _N_E
            else:
                return self._number_end(ch)
        elif sub in (_N_DOT, _N_FRAC):
            if digit:
                nxt = _N_FRAC
            elif sub == _N_FRAC and ch in "eE":
                nxt = _N_E
            elif sub == _N_FRAC:
                return self._number_end(ch)
            else:
                nxt = -1
        elif sub == _N_E:
            nxt = _N_ESIGN if ch in "+-" else _N_EXP if digit else -1
        elif sub == _N_ESIGN:
            nxt = _N_EXP if digit else -1
        else:                                             # _N_EXP
            if digit:
                return CONTINUE
            return self._number_end(ch)
        if nxt < 0:
            return INVALID
        self._sub = nxt
        return CONTINUE

    def _number_end(self, ch: str) -> int:
        """A number ended just before `ch`: finish it, then `ch` continues the enclosing container."""
        self._scalar = ""
        if not self._stack:
            self._finished = True
            return DONE_BEFORE
        self._value_done()
        return self._structure(ch)

    # -- structure ----------------------------------------------------------------------------------

    def _start_value(self, ch: str) -> int:
        self._started = True
        if ch == "{":
            self._stack.append(_OBJ_KEY_OR_END)
        elif ch == "[":
            self._stack.append(_ARR_VALUE_OR_END)
        elif ch == '"':
            self._scalar, self._sub = "string", 0
        elif ch == "-" or ch in _DIGITS:
            self._scalar = "number"
            self._sub = _N_MINUS if ch == "-" else _N_ZERO if ch == "0" else _N_INT
        elif ch in _LITERALS:
            self._scalar, self._literal = "literal", _LITERALS[ch][1:]
        else:
            return INVALID
        return CONTINUE

    def _structure(self, ch: str) -> int:
        stack = self._stack
        if not stack:
            return INVALID if self._started else self._start_value(ch)
        state = stack[-1]
        if ch in _WS:
            return CONTINUE
        if state in (_OBJ_KEY_OR_END, _OBJ_KEY):
            if ch == '"':
                stack[-1] = _OBJ_KEY
                self._scalar, self._sub = "string", 0
                return CONTINUE
            if ch == "}" and state == _OBJ_KEY_OR_END:
                stack.pop()
                return self._value_done()
            return INVALID
        if state == _OBJ_COLON:
            if ch != ":":
                return INVALID
            stack[-1] = _OBJ_VALUE
            return CONTINUE
        if state in (_OBJ_VALUE, _ARR_VALUE):
            return self._start_value(ch)
        if state == _ARR_VALUE_OR_END:
            if ch == "]":
                stack.pop()
                return self._value_done()
            stack[-1] = _ARR_VALUE
            return self._start_value(ch)
        # _OBJ_COMMA_OR_END / _ARR_COMMA_OR_END
        if ch == ",":
            stack[-1] = _OBJ_KEY if state == _OBJ_COMMA_OR_END else _ARR_VALUE
            return CONTINUE
        if ch == ("}" if state == _OBJ_COMMA_OR_END else "]"):
            stack.pop()
            return self._value_done()
        return INVALID

    def _value_done(self) -> int:
        """A value closed: the whole value is done, or its container moves on."""
        stack = self._stack
        if not stack:
            self._finished = True
            return DONE
        state = stack[-1]
        if state == _OBJ_VALUE:
            stack[-1] = _OBJ_COMMA_OR_END
        elif state in (_ARR_VALUE, _ARR_VALUE_OR_END):
            stack[-1] = _ARR_COMMA_OR_END
        return CONTINUE
