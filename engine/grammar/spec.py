"""`StructuredSpec`: what a request's output must match, in one canonical, hashable value.

The router turns every request surface (`response_format`, vLLM's `structured_outputs`, the
older `guided_*` fields, forced tool calls) into one of these, validates it, and sends it to both
pods inside `SamplingParams`; each pod compiles it (cached by `key`) into its own matcher. It is
torch-free because the router imports it.

Kinds and their `text`:
- `json_schema`: the schema as canonical JSON (sorted keys, no spaces);
- `json_object`: any JSON object (`text` is empty);
- `regex`: the pattern;
- `choice`: a JSON list of the allowed strings (canonical JSON);
- `lark`: a Lark grammar (llguidance's dialect, `%json {...}` allowed); GBNF is converted to Lark
  in the router, so pods see one grammar language.

`any_whitespace` False (the default) bounds JSON whitespace, so a model cannot run away in
whitespace until `max_tokens`. `after_token_ids`, when not empty, leaves the output free until it
contains that token sequence (the end of a reasoning model's thinking) and constrains from there.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


class StructuredSpecError(ValueError):
    """A spec that is not one of `KINDS` or whose text is not of its kind's form."""


def canonical_json(value: Any) -> str:
    """The one text of a JSON value (sorted keys, no spaces), so equal schemas share a cache key."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class StructuredSpec:
    kind: str
    text: str = ""
    any_whitespace: bool = False
    after_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.after_token_ids, list):
            object.__setattr__(self, "after_token_ids", tuple(self.after_token_ids))
        if self.kind not in KINDS:
            raise StructuredSpecError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.text, str):
            raise StructuredSpecError("text must be a string")
        if self.kind == "json_object" and self.text:
            raise StructuredSpecError("a json_object spec has no text")
        if self.kind in ("json_schema", "choice"):
            try:
                value = json.loads(self.text)
            except ValueError as e:
                raise StructuredSpecError(f"{self.kind} text is not JSON: {e}") from None
            if self.kind == "choice" and not (isinstance(value, list) and value
                                              and all(isinstance(c, str) for c in value)):
                raise StructuredSpecError("choice text must be a non-empty JSON list of strings")
        if self.kind in ("regex", "lark") and not self.text:
            raise StructuredSpecError(f"a {self.kind} spec needs text")

    @functools.cached_property
    def key(self) -> str:
        """sha256 of everything that changes the compiled grammar (the compile caches' key).
        Computed once per spec: a 128-tool grammar's text is ~50 kB, ~0.3 ms to hash, and every
        cache lookup and fingerprint (the decode pod's first-token handoff) reads the key."""
        h = hashlib.sha256()
        h.update(canonical_json([self.kind, self.text, self.any_whitespace, list(self.after_token_ids)])
                 .encode())
        return h.hexdigest()


def to_proto(spec: StructuredSpec, msg: Any) -> Any:
    """Fill a `cbserve_pb2.StructuredSpec` message."""
    msg.kind = spec.kind
    msg.text = spec.text
    msg.any_whitespace = spec.any_whitespace
    del msg.after_token_ids[:]
    msg.after_token_ids.extend(spec.after_token_ids)
    return msg


def from_proto(msg: Any) -> StructuredSpec:
    """Build (and check) a spec from a wire message; raises `StructuredSpecError`."""
    return StructuredSpec(kind=msg.kind, text=msg.text, any_whitespace=msg.any_whitespace,
                          after_token_ids=tuple(msg.after_token_ids))
