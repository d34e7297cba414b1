"""Prefill progress events, from the engine thread to the asyncio stream that ships the KV.

The prefill engine runs in its own thread; `PullKV` streams run on the pod's event loop. The
engine reports each step's progress on a request with `KVProgress.advance` (and `finish` with the
first token, or `fail`), from any thread, without blocking; each pull consumes
`KVProgress.events()`. Events coalesce: a consumer that falls behind sees only the latest
`num_computed_tokens`, which is all the source needs (it ships every block that is full by then).
A pull that starts late (the prompt is half done, or finished and held) first sees the current
state, so the same code serves "stream while prefilling" and "pull a held request".
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from wire import cbserve_pb2
from kvtransfer.errors import SourceAbortedError


@dataclass(frozen=True)
class ComputedTokens:
    """The first `num_computed_tokens` prompt tokens have KV in `block_ids` (the request's block
    table so far; it may only grow while the KV streams)."""

    num_computed_tokens: int
    block_ids: tuple[int, ...]
    group_block_ids: tuple[tuple[int, ...], ...] = ()   # KV groups 1..'s tables (`kvtransfer.kv_groups`)


@dataclass(frozen=True)
class FirstToken:
    """Prefill is complete (every prompt token has KV in `block_ids`) and the first output token
    was sampled."""

    token_id: int
    block_ids: tuple[int, ...]
    logprobs: cbserve_pb2.TokenLogprobs | None = None
    grammar_fingerprint: str = ""   # structured output: what the token was sampled under
    prompt_logprobs: cbserve_pb2.PromptLogprobs | None = None   # when the request asked
    group_block_ids: tuple[tuple[int, ...], ...] = ()   # KV groups 1..'s tables (`kvtransfer.kv_groups`)


KVEvent = ComputedTokens | FirstToken


class KVProgress:
    """Thread-safe progress of one request's prefill; any number of asyncio consumers."""

    def __init__(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens <= 0:
            raise ValueError(f"num_prompt_tokens must be positive, got {num_prompt_tokens}")
        self.num_prompt_tokens = num_prompt_tokens
        self._lock = threading.Lock()
        self._computed = ComputedTokens(0, ())
        self._first_token: FirstToken | None = None
        self._failure: str | None = None
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def advance(self, num_computed_tokens: int, block_ids: Sequence[int],
                group_block_ids: Sequence[Sequence[int]] = ()) -> None:
        """Engine thread: the prompt's KV is computed up to `num_computed_tokens` (in `block_ids`,
        and with KV groups in groups 1..'s tables `group_block_ids`)."""
        if not 0 <= num_computed_tokens <= self.num_prompt_tokens:
            raise ValueError(f"num_computed_tokens {num_computed_tokens} outside "
                             f"0..{self.num_prompt_tokens}")
        with self._lock:
            if num_computed_tokens >= self._computed.num_computed_tokens:
                self._computed = ComputedTokens(num_computed_tokens, tuple(block_ids), _tables(group_block_ids))
        self._wake()

    def finish(self, token_id: int, block_ids: Sequence[int],
               logprobs: cbserve_pb2.TokenLogprobs | None = None, grammar_fingerprint: str = "",
               prompt_logprobs: cbserve_pb2.PromptLogprobs | None = None,
               group_block_ids: Sequence[Sequence[int]] = ()) -> None:
        """Engine thread: prefill done, first token sampled (under the grammar named by
        `grammar_fingerprint`, if the request has one; and the prompt scored, if asked)."""
        with self._lock:
            tables = _tables(group_block_ids)
            self._computed = ComputedTokens(self.num_prompt_tokens, tuple(block_ids), tables)
            self._first_token = FirstToken(token_id, tuple(block_ids), logprobs, grammar_fingerprint,
                                           prompt_logprobs, tables)
        self._wake()

    def fail(self, reason: str) -> None:
        """Engine thread: the request was aborted or lost its blocks; consumers raise
        `SourceAbortedError(reason)`."""
        with self._lock:
            self._failure = reason
        self._wake()

    @property
    def finished(self) -> bool:
        with self._lock:
            return self._first_token is not None

    async def events(self) -> AsyncIterator[KVEvent]:
        """The current state, then each change, ending with `FirstToken` (or raising
        `SourceAbortedError`)."""
        loop = asyncio.get_running_loop()
        wakeup = asyncio.Event()
        waiter = (loop, wakeup)
        with self._lock:
            self._waiters.add(waiter)
        try:
            last_seen = 0  # nothing to report before the first computed token
            while True:
                wakeup.clear()
                with self._lock:
                    computed, first, failure = self._computed, self._first_token, self._failure
                if failure is not None:
                    raise SourceAbortedError(failure)
                if first is not None:
                    yield first
                    return
                if computed.num_computed_tokens > last_seen:
                    last_seen = computed.num_computed_tokens
                    yield computed
                    continue  # re-check state before sleeping: it may have moved meanwhile
                await wakeup.wait()
        finally:
            with self._lock:
                self._waiters.discard(waiter)

    def _wake(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the consumer's loop is closed: it has nothing left to wake
                pass


def _tables(group_block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(map(tuple, group_block_ids))
