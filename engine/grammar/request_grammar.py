"""One request's grammar state: the compile it waits for, its matcher, and how far the matcher has
followed the request's output.

The matcher is never told "here is a new token"; it is synced to the output (`sync`), consuming
the output positions it has not seen yet. So each output token is accepted exactly once, whoever
calls and however often: after every step, when a decode pod takes over from a prefill pod's
first token, after a preemption that recomputes the KV but keeps the tokens (SGLang's P/D
double-accept bug, #29110, cannot happen by construction).

With `after_token_ids` (the end of a reasoning model's thinking) the output is free until that
sequence appears in it, and the matcher starts at the token after it, wherever that happens: on
the prefill pod's first token or any later one on the decode pod.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Sequence

from engine.grammar.backend import CompiledGrammar, GrammarMatcher
from engine.grammar.spec import StructuredSpec
from engine.scheduling.output import PLACEHOLDER_TOKEN_ID


class RequestGrammar:
    __slots__ = ("spec", "future", "matcher", "num_seen", "constrain_from", "error")

    def __init__(self, spec: StructuredSpec, future: Future[CompiledGrammar]) -> None:
        self.spec = spec
        self.future = future
        self.matcher: GrammarMatcher | None = None
        self.num_seen = 0                  # output tokens already looked at
        # Output index of the first constrained token; None while the output is still free.
        self.constrain_from: int | None = None if spec.after_token_ids else 0
        self.error = ""                    # why the matcher failed (the request must end)

    @property
    def constrained(self) -> bool:
        """The next token is under the grammar."""
        return self.constrain_from is not None

    def start(self, compiled: CompiledGrammar) -> None:
        """Take a fresh matcher from the compiled grammar (once the compile is done)."""
        self.matcher = compiled.matcher()

    def sync(self, output_token_ids: Sequence[int]) -> bool:
        """Consume the output tokens not seen yet (up to a placeholder still on the device); before
        `start` they wait. False when the grammar rejects one: `error` says why, and the request
        must end."""
        if self.error:
            return False
        end = len(output_token_ids)
        if end and output_token_ids[-1] == PLACEHOLDER_TOKEN_ID:
            end -= 1
        if self.constrain_from is None:
            self._find_start(output_token_ids, end)
            if self.constrain_from is None:
                self.num_seen = end
                return True
            self.num_seen = max(self.num_seen, self.constrain_from)
        matcher = self.matcher
        if matcher is None:
            return True
        for position in range(self.num_seen, end):
            if not matcher.accept(output_token_ids[position]):
                self.error = matcher.error or f"output token {output_token_ids[position]} rejected"
                self.num_seen = end
                return False
        self.num_seen = end
        return True

    def _find_start(self, output: Sequence[int], end: int) -> None:
        """Look for `after_token_ids` ending in output[num_seen:end] (it may begin before)."""
        marker = self.spec.after_token_ids
        width = len(marker)
        for stop in range(max(self.num_seen + 1, width), end + 1):
            if tuple(output[stop - width:stop]) == marker:
                self.constrain_from = stop
                return

    def is_terminated(self) -> bool:
        matcher = self.matcher
        return matcher is not None and self.constrained and matcher.is_terminated()

    def reset(self) -> None:
        """Forget the output (a decode pod that prefills locally after refusing the first token)."""
        self.matcher = None
        self.num_seen = 0
        self.constrain_from = None if self.spec.after_token_ids else 0
        self.error = ""
