"""Turning a `Constraint` into the canonical `StructuredSpec` the pods compile, and refusing
every one they could not.

Checks, in order of cost: the size of the constraint's text (bytes, `--max-schema-bytes`), the
nesting depth of a schema (`--max-schema-depth`), then llguidance itself, the library the pods
compile with, so a spec that passes here compiles there. llguidance validates against the
model's own tokenizer when it can be built (special-token references such as `<[id]>` in a tool
grammar are checked too) and without one otherwise. Its messages name the offending keyword
("Unimplemented keys: [\"uniqueItems\"]", "Unknown format: ...", a regex's position), and the
400 carries them with the field the client used. The grammar text is the pods' own
(`engine.grammar.source.grammar_source`), so router and pods agree on what a spec means.
llguidance is torch-free and has no dependencies.

Validation costs milliseconds for a large schema, so handlers run it in the tokenizer's worker
threads (`PromptEncoder.run`), never on the event loop.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from engine.grammar.source import grammar_source, short_error
from engine.grammar.spec import StructuredSpec, StructuredSpecError, canonical_json
from router.errors import bad_request
from router.structured.surface import Constraint

log = logging.getLogger(__name__)
VERDICT_CACHE_ENTRIES = 4096


@dataclass(frozen=True)
class StructuredLimits:
    """Bounds on what one request may ask the grammar compiler to do (router flags of these names)."""

    max_schema_bytes: int = 64 << 10     # one schema, regex, grammar or choice list, as canonical text
    max_schema_depth: int = 32           # nesting of objects and arrays inside one schema
    max_tools: int = 128                 # tools (or legacy functions) in one request

    def __post_init__(self) -> None:
        for name in ("max_schema_bytes", "max_schema_depth", "max_tools"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def json_depth(value: Any) -> int:
    """Nesting depth of objects and arrays (a scalar is 0, `{}` is 1); iterative, so any input is safe."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def no_additional_properties(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that does not say
    (vLLM's `disable_additional_properties`)."""
    if isinstance(schema, list):
        return [no_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: no_additional_properties(value) for key, value in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class SpecValidator:
    """Builds and validates specs for one model; one per app (it holds the llguidance tokenizer)."""

    def __init__(self, limits: StructuredLimits, tokenizer_json: str | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.limits = limits
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()    # spec key -> error or None
        self._lock = threading.Lock()                                     # handlers' worker threads
        self._lltokenizer = None
        if tokenizer_json is not None:
            try:
                self._lltokenizer = llguidance.LLTokenizer(tokenizer_json,
                                                           eos_token=list(eos_token_ids) or None)
            except (ValueError, RuntimeError) as exc:   # validation still runs, without a tokenizer
                log.warning("llguidance cannot load this tokenizer (%s); grammars are validated without it", exc)

    # -- limits -------------------------------------------------------------------------------------

    def check_size(self, text: str, param: str) -> None:
        size = len(text.encode())
        if size > self.limits.max_schema_bytes:
            raise bad_request(f"{param}: {size} bytes; at most {self.limits.max_schema_bytes} are accepted "
                              f"(--max-schema-bytes)", param=param, code="schema_too_large")

    def check_schema(self, schema: Any, param: str) -> str:
        """The schema's canonical text, after the size and depth limits."""
        depth = json_depth(schema)
        if depth > self.limits.max_schema_depth:
            raise bad_request(f"{param}: nested {depth} levels deep; at most {self.limits.max_schema_depth} are "
                              f"accepted (--max-schema-depth)", param=param, code="schema_too_deep")
        text = canonical_json(schema)
        self.check_size(text, param)
        return text

    # -- specs --------------------------------------------------------------------------------------

    def spec_for(self, constraint: Constraint, after_token_ids: Sequence[int] = ()) -> StructuredSpec:
        """The canonical, validated spec for `constraint`; raises a 400 naming `constraint.param`."""
        param, value = constraint.param, constraint.value
        if constraint.kind == "json_schema":
            schema = no_additional_properties(value) if constraint.disable_additional_properties else value
            text, kind = self.check_schema(schema, param), "json_schema"
        elif constraint.kind == "json_object":
            text, kind = "", "json_object"
        elif constraint.kind == "choice":
            text, kind = canonical_json(list(value)), "choice"
            self.check_size(text, param)
        elif constraint.kind == "regex":
            self.check_size(value, param)
            text, kind = value, "regex"
        else:
            self.check_size(value, param)
            text, kind = self.to_lark(value, param), "lark"
        try:
            spec = StructuredSpec(kind, text, any_whitespace=constraint.any_whitespace,
                                  after_token_ids=tuple(after_token_ids))
        except StructuredSpecError as exc:
            raise bad_request(f"{param}: {exc}", param=param) from None
        self.validate(spec, param)
        return spec

    @staticmethod
    def to_lark(grammar: str, param: str) -> str:
        """A Lark grammar as it is, a GBNF one converted (the pods see Lark only)."""
        if not grammar.strip():
            raise bad_request(f"{param}: the grammar is empty", param=param)
        try:
            return any_to_lark(grammar)
        except Exception as exc:  # noqa: BLE001 - the converter raises whatever its parser hits
            raise bad_request(f"{param}: not a valid GBNF grammar: {exc}", param=param) from None

    def validate(self, spec: StructuredSpec, param: str) -> None:
        """A 400 naming `param` unless llguidance compiles `spec` (the pods' `grammar_source`).

        Verdicts are remembered by `spec.key` (LRU): agents send the same tools and schemas on
        every turn, and a 128-tool grammar costs a few hundred ms to check cold."""
        key = spec.key
        with self._lock:
            known = key in self._verdicts
            if known:
                self._verdicts.move_to_end(key)
                error = self._verdicts[key]
        if not known:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_source(spec),
                                                                                     self._lltokenizer)
            error = (short_error(messages[0]) if messages else "invalid grammar") if is_error else None
            with self._lock:
                self._verdicts[key] = error
                while len(self._verdicts) > VERDICT_CACHE_ENTRIES:
                    self._verdicts.popitem(last=False)
        if error is not None:
            raise bad_request(f"{param}: {error}", param=param, code="invalid_grammar")
