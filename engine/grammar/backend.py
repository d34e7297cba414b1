"""The grammar backend interface: compile a spec for one tokenizer once, then a matcher per request.

`GrammarBackend.compile(spec)` is the expensive part (run on the compiler's thread pool and
cached, `engine.grammar.compiler`); `CompiledGrammar.matcher()` is cheap and gives each request
(each of `n` choices) its own state. A matcher follows one output: it fills the row of allowed
next tokens, accepts the sampled token, can roll back (speculative decoding) and says when the
grammar is done. Rows are llguidance's (and xgrammar's) layout: packed int32 words, LSB first,
bit 1 = allowed, token `t` is bit `t % 32` of word `t // 32`, `ceil(vocab_width / 32)` words.

Errors: `GrammarCompileError` (a `ValueError`: the request's grammar, e.g. too complex for the
backend's limits or naming a token this tokenizer lacks) and `GrammarError` (a matcher went
wrong mid-generation, which the mask should make impossible: a server fault). Both end the
request with a clear error; neither ever lets it continue unconstrained.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from engine.grammar.spec import StructuredSpec


# What `GrammarBackend.accept_tokens` says of each matcher's token.
REJECTED, ACCEPTED, TERMINATED = 0, 1, 2


class GrammarCompileError(ValueError):
    """The spec does not compile for this tokenizer (the request's fault)."""


class GrammarError(RuntimeError):
    """A matcher failed while following an output (the server's fault)."""


class GrammarMatcher(Protocol):
    """One output's position in a compiled grammar."""

    def accept(self, token_id: int) -> bool:
        """Advance over `token_id`; False when the grammar rejects it (the matcher is then
        unusable: `error` says why)."""

    def can_accept(self, token_id: int) -> bool:
        """Would `accept(token_id)` succeed? Changes nothing."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepts."""

    def is_terminated(self) -> bool:
        """No token but an end-of-sequence one can follow (the output is complete)."""

    def copy(self) -> GrammarMatcher:
        """An independent matcher at the same position."""

    @property
    def error(self) -> str:
        """Why the matcher failed; empty while it is healthy."""


class CompiledGrammar(Protocol):
    spec_key: str

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""


class GrammarBackend(Protocol):
    name: str
    version: str
    tokenizer_hash: str      # what the backend's token table was built from
    vocab_width: int         # bits per row: the model's logits width

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """Raises `GrammarCompileError`; may run on any thread."""

    def fill_bitmask(self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """Write each matcher's allowed next tokens into row `index` of `bitmask`
        (`int32[rows, ceil(vocab_width / 32)]`, C-contiguous); rows not named are left as they are."""

    def accept_tokens(self, pairs: Sequence[tuple[GrammarMatcher, int]]) -> list[int]:
        """Each matcher accepts its token (`accept`), all in one call (a step's batch): per pair
        `ACCEPTED`, `TERMINATED` (accepted, and the grammar is complete: `is_terminated`) or
        `REJECTED` (the matcher's `error` says why)."""

    def fill_bitmask_nogil(self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """`fill_bitmask` in one call that holds the GIL only to start and to finish: for a thread
        beside the engine's (`engine.grammar.fill_ahead`), which a call per row would make
        trade the GIL with the engine thread once a row."""
