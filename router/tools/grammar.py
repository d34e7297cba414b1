"""Lark grammars (llguidance's dialect, `%json` for arguments) that force tool calls in a model's
own format: `tool_choice: "required"` (one or more calls of any tool), a named function (exactly
that one), `parallel_tool_calls: false` (exactly one call), and `auto` next to a `response_format`
(calls, or an answer in the format) or with `strict` tools (calls, or free text that the format's
parser reads as no call: `free_answer`).

Each call is its own `%json` schema, `{"name": {"const": ...}, "<args>": <the tool's parameters>}`
with keys in that order and the separators of `json.dumps` (`", "`, `": "`), which is the text
chat templates render calls as, so the model stays in the shape it was trained on (llguidance's
tool-calling guide and SGLang prefer this to vLLM's bare JSON array; vLLM's list is kept as the
`json` format for servers with no parser). A tool's `$defs` move to its call's root, where its
`#/$defs/...` references point. Whitespace inside calls is fixed, so a random or confused model
cannot run away in it; before the first call a line break or two are allowed (what a reasoning
model writes after `</think>`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from engine.grammar.source import json_whitespace_options
from router.tools.formats import CallSyntax
from router.tools.stream import ToolFormat

# `x-guidance` options on every forced JSON value: fixed whitespace, json.dumps' separators.
CALL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def call_schema(name: str, parameters: dict[str, Any] | None, syntax: CallSyntax) -> dict[str, Any]:
    """The JSON schema of one call of `name` (keys in the order the model writes them)."""
    params = dict(parameters) if parameters else dict(EMPTY_PARAMETERS)
    defs = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {syntax.name_key: {"const": name}, syntax.args_key: params},
        "required": [syntax.name_key, syntax.args_key],
        "additionalProperties": False,
        **defs,
        "x-guidance": CALL_JSON_OPTIONS,
    }
    return schema


def _pieces(parts: Sequence[str], literal: Callable[[str], str]) -> str:
    return " ".join(literal(p) for p in parts)


def think_block(start: str, end: str) -> str:
    """A whole thinking block as a Lark expression (`start`, `end`: the spelled tags). Used `lazy`:
    it ends at the first end tag, so the answer after it is the grammar's again."""
    return f"{start} /(.|\\n)*/ {end}"


def _start(body: str, think: str | None, rules: list[str]) -> str:
    """The start rule: `body`, after an optional thinking block when `think` is given (a model
    that thinks only if its output opens with the tag: the grammar allows both, so nothing is
    left unconstrained when it does not think)."""
    if think is None:
        return f"start: {body}"
    rules.append(f"think[lazy]: {think}")
    return f"start: think? ({body})"


def calls_lark(syntax: CallSyntax, tools: Sequence[tuple[str, dict[str, Any] | None]], *, parallel: bool,
               literal: Callable[[str], str], answer: str | None = None, think: str | None = None,
               tokens: dict[str, str] | None = None) -> str:
    """A grammar whose every sentence is one call (or, with `parallel`, one or more) of `tools`
    (`(name, parameters)` pairs), in `syntax`; or, given `answer` (a Lark expression), either that
    or an answer matching it; after an optional `think` block (`think_block`). `tokens`: terminal
    rules `answer` uses (`{NAME: body}`, e.g. `free_answer`'s).

    `literal(text)` spells a piece of the syntax: a quoted string, or a special token."""
    rules = ["%llguidance {}"] + [f"{name}: {body}" for name, body in (tokens or {}).items()]
    call = " ".join(p for p in (_pieces(syntax.open, literal), "fn", _pieces(syntax.close, literal)) if p)
    more = f' ({_pieces(syntax.sep, literal)} call)*' if parallel else ""
    body = " ".join(p for p in (_pieces(syntax.prefix, literal), f"call{more}", _pieces(syntax.suffix, literal))
                    if p)
    rules.insert(1, _start("calls | answer" if answer is not None else "calls", think, rules))
    rules.append(f'calls: LEAD? {body}')
    rules.append(r"LEAD: /[ \n]{1,2}/")
    rules.append(f"call: {call}")
    rules.append("fn: " + " | ".join(f"fn_{i}" for i in range(len(tools))))
    for i, (name, parameters) in enumerate(tools):
        rules.append(f"fn_{i}: %json " + json.dumps(call_schema(name, parameters, syntax), ensure_ascii=False))
    if answer is not None:
        rules.append(f"answer: {answer}")
    return "\n".join(rules) + "\n"


def answer_lark(answer: str, think: str) -> str:
    """A grammar for `answer` (a Lark expression) after an optional `think` block."""
    rules = ["%llguidance {}"]
    rules.insert(1, _start("LEAD? answer", think, rules))
    rules += [r"LEAD: /[ \n]{1,2}/", f"answer: {answer}"]
    return "\n".join(rules) + "\n"


ANY_TEXT = r"/(.|\n)*/"


def free_answer(parse: ToolFormat, is_special: Callable[[str], bool]) -> str:
    """The body of a terminal rule (`&` and `~` work on terminals only) for free text that `parse`
    reads as no call: where calls follow a marker anywhere, text without that marker; where the
    reply itself is the calls (anchored formats), text that does not open like them (`{` or `[`,
    or the prefix marker, after whitespace). A marker that is a special token (`is_special`) never
    appears in text, so it needs no exclusion."""
    if parse.start_marker is not None:
        if is_special(parse.start_marker):
            return ANY_TEXT
        return rf"{ANY_TEXT} & ~/(.|\n)*{_regex(parse.start_marker)}(.|\n)*/"
    opens = [r"\[" if parse.array else r"\{"]
    if parse.start_prefix and not is_special(parse.start_prefix):
        opens.append(_regex(parse.start_prefix))
    return rf"{ANY_TEXT} & ~/[ \t\n\r]*({'|'.join(opens)})(.|\n)*/"


def _regex(text: str) -> str:
    """`text` matched literally inside a Lark `/.../` regex."""
    return re.escape(text).replace("/", "\\/")


def json_answer(schema: dict[str, Any] | None, any_whitespace: bool) -> str:
    """A Lark expression for a JSON answer (`schema` None: any object), with the whitespace rule
    a `json_schema` spec has on its own."""
    value = dict(schema) if schema is not None else {"type": "object"}
    value["x-guidance"] = {**value.get("x-guidance", {}), **json_whitespace_options(any_whitespace)}
    return "%json " + json.dumps(value, ensure_ascii=False)


def regex_answer(pattern: str) -> str:
    """`pattern` as a Lark regex literal: `/.../` with its unescaped slashes escaped."""
    out, escaped = [], False
    for ch in pattern:
        out.append("\\/" if ch == "/" and not escaped else ch)
        escaped = ch == "\\" and not escaped
    return "/" + "".join(out) + "/"


def choice_answer(choices: Sequence[str]) -> str:
    return " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
