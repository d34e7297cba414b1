"""The tool-call formats (`--tool-call-parser`): how each model family writes calls, for reading
them (`ToolFormat`, see `router.tools.stream`) and for forcing them (`CallSyntax`, see
`router.tools.grammar`).

- `hermes`: Hermes 2/3, Qwen2.5, Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, text before them;
- `llama3_json`: Llama 3.1/3.2: the reply *is* `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several joined by `; `;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after optional text, and the v11
  form `[TOOL_CALLS]name[ARGS]{...}`; ids are 9 alphanumerics, as Mistral's templates require;
- `json`: no parser configured: `tool_choice` `required` or a named function forces a plain JSON
  list of `{"name", "parameters"}` (vLLM's shape), read back the same way. `auto` needs a parser.

Markers that are special tokens in a model's vocabulary (`[TOOL_CALLS]`, `<|python_tag|>`) are
forced as that token and read with special tokens kept in the text (`skip_special_tokens=False`,
as vLLM's mistral parser does).
"""

from __future__ import annotations

from dataclasses import dataclass

from router.tools.stream import ToolFormat


@dataclass(frozen=True)
class CallSyntax:
    """The text around forced calls: `prefix (open CALL close) (sep open CALL close)* suffix`.

    Each part is a tuple of pieces; a piece that is a special token is forced as that token."""

    prefix: tuple[str, ...] = ()
    open: tuple[str, ...] = ()
    close: tuple[str, ...] = ()
    sep: tuple[str, ...] = ()
    suffix: tuple[str, ...] = ()
    name_key: str = "name"
    args_key: str = "arguments"


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    parse: ToolFormat
    force: CallSyntax

    @property
    def markers(self) -> tuple[str, ...]:
        """The marker strings (special tokens in some vocabularies)."""
        p = self.parse
        return tuple(m for m in (p.start_marker, p.start_prefix, p.end_marker, p.name_args_marker) if m)


HERMES = ToolCallFormat(
    "hermes",
    ToolFormat(start_marker="<tool_call>", end_marker="</tool_call>"),
    CallSyntax(open=("<tool_call>", "\n"), close=("\n", "</tool_call>"), sep=("\n",)))
LLAMA3_JSON = ToolCallFormat(
    "llama3_json",
    ToolFormat(start_prefix="<|python_tag|>", separator=";"),
    CallSyntax(sep=("; ",), args_key="parameters"))
MISTRAL = ToolCallFormat(
    "mistral",
    ToolFormat(start_marker="[TOOL_CALLS]", array=True, name_args_marker="[ARGS]", id_length=9),
    CallSyntax(prefix=("[TOOL_CALLS]", "["), sep=(", ",), suffix=("]",)))
JSON_LIST = ToolCallFormat(
    "json",
    ToolFormat(array=True),
    CallSyntax(prefix=("[",), sep=(", ",), suffix=("]",), args_key="parameters"))

TOOL_CALL_PARSERS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
