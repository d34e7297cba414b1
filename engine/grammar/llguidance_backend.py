"""The llguidance grammar backend (the default): zero dependencies, near-instant compiles, fuel
limits on every compile and mask step, masks filled in parallel with the GIL released.

The token table is built from cbserve's own `Tokenizer` (its `tokenizer.json`, special tokens
included), the way llguidance's Hugging Face helper builds it from `transformers`, with the
vocabulary padded to the model's logits width: ids past the tokenizer's (embedding rows no token
maps to) have no bytes, so no grammar ever allows them. Building the table walks the whole
vocabulary (about a second for 128k tokens, but quadratic in the number of *added* tokens, so a
tokenizer with tens of thousands of them takes minutes): the compiler builds it once, off the
engine thread, before its first compile.

A compiled grammar is a pristine `LLMatcher` that is never advanced; each request's matcher is a
`deep_copy` of it (microseconds), so `n` choices and repeated schemas share one compile.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Sequence

import llguidance
import numpy as np

from engine.grammar.backend import ACCEPTED, REJECTED, TERMINATED, GrammarCompileError
from engine.grammar.source import grammar_source, short_error
from engine.grammar.spec import StructuredSpec
from engine.tokenizer import Tokenizer

# Below this many (rows x vocabulary) a batch's masks are filled on the calling thread: at ~10 us a
# mask (small vocabularies) handing rows to the executor's threads costs more than it saves.
PARALLEL_FILL_TOKENS = 1 << 20


class LLGuidanceMatcher:
    """`GrammarMatcher` over one `llguidance.LLMatcher`."""

    __slots__ = ("inner",)

    def __init__(self, inner: llguidance.LLMatcher) -> None:
        self.inner = inner

    def accept(self, token_id: int) -> bool:
        return self.inner.consume_token(token_id)

    def can_accept(self, token_id: int) -> bool:
        return not self.inner.is_error() and self.inner.validate_tokens([token_id]) == 1

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        inner = self.inner
        return inner.is_stopped() and not inner.is_error()

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.inner.deep_copy())

    @property
    def error(self) -> str:
        inner = self.inner
        return short_error(inner.get_error()) if inner.is_error() else ""


class LLGuidanceGrammar:
    """`CompiledGrammar`: the pristine matcher every request's matcher is copied from."""

    __slots__ = ("spec_key", "_start")

    def __init__(self, spec_key: str, start: llguidance.LLMatcher) -> None:
        self.spec_key = spec_key
        self._start = start

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._start.deep_copy())


class LLGuidanceBackend:
    """`GrammarBackend` for one tokenizer and logits width."""

    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_width: int, eos_token_ids: Sequence[int],
                 num_threads: int | None = None) -> None:
        self.version = llguidance.__version__
        self.vocab_width = vocab_width
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        table = tokenizer.to_json()
        self.tokenizer_hash = hashlib.sha256(
            json.dumps([table, list(self.eos_token_ids), vocab_width]).encode()).hexdigest()
        self._tokenizer = llguidance.LLTokenizer(table, n_vocab=vocab_width, eos_token=list(self.eos_token_ids))
        # Masks of a batch in parallel (the GIL is released inside); a few threads are plenty at
        # ~50 us per mask, and the engine shares the host with the pod's other processes.
        self._num_threads = num_threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._executor = llguidance.LLExecutor(self._num_threads)
        self.words_per_row = (vocab_width + 31) // 32

    def compile(self, spec: StructuredSpec) -> LLGuidanceGrammar:
        try:
            source = grammar_source(spec)
        except ValueError as e:
            raise GrammarCompileError(f"structured output ({spec.kind}): {e}") from None
        start = llguidance.LLMatcher(self._tokenizer, source, log_level=0)
        if start.is_error():
            raise GrammarCompileError(f"structured output ({spec.kind}) does not compile: "
                                      f"{short_error(start.get_error())}")
        return LLGuidanceGrammar(spec.key, start)

    def fill_bitmask(self, matchers: Sequence[tuple[LLGuidanceMatcher, int]], bitmask: np.ndarray) -> None:
        rows, words = self._shape(bitmask)
        if self._num_threads > 1 and len(matchers) * self.vocab_width >= PARALLEL_FILL_TOKENS:
            self._fill_in_one_call(matchers, bitmask, rows, words)
            return
        base = bitmask.ctypes.data
        for matcher, row in matchers:   # small batches: a thread handoff costs more than the masks
            if not 0 <= row < rows:
                raise IndexError(f"row {row} outside the bitmask's {rows}")
            matcher.inner.unsafe_compute_mask_ptr(base + row * words * 4, words * 4)

    def accept_tokens(self, pairs: Sequence[tuple[LLGuidanceMatcher, int]]) -> list[int]:
        # One loop over the llguidance objects: a step at batch 128 spent ~5 µs a row in the
        # Python frames of `accept` and `is_terminated` around two ~1 µs calls. (The executor's
        # `consume_token_par` measured no faster with two threads and ~25x slower with one.)
        out = []
        append = out.append
        for matcher, token in pairs:
            inner = matcher.inner
            if not inner.consume_token(token):
                append(REJECTED)
            else:
                append(TERMINATED if inner.is_stopped() and not inner.is_error() else ACCEPTED)
        return out

    def fill_bitmask_nogil(self, matchers: Sequence[tuple[LLGuidanceMatcher, int]], bitmask: np.ndarray) -> None:
        self._fill_in_one_call(matchers, bitmask, *self._shape(bitmask))

    def _fill_in_one_call(self, matchers: Sequence[tuple[LLGuidanceMatcher, int]], bitmask: np.ndarray,
                          rows: int, words: int) -> None:
        """On the executor's threads, the GIL released (it checks each row is below `rows`)."""
        self._executor.unsafe_compute_mask_ptr([(m.inner, row) for m, row in matchers], bitmask.ctypes.data,
                                               words * 4, rows)

    def _shape(self, bitmask: np.ndarray) -> tuple[int, int]:
        rows, words = bitmask.shape
        if words != self.words_per_row or bitmask.dtype != np.int32 or not bitmask.flags.c_contiguous:
            raise ValueError(f"bitmask must be C-contiguous int32 [rows, {self.words_per_row}], "
                             f"got {bitmask.dtype} {bitmask.shape}")
        return rows, words
