"""`StructuredOutputs`: the engine's side of constrained decoding (one per engine, engine thread).

A request with a `StructuredSpec`:
1. `add`: its compile starts on the compiler's pool (or is found in the LRU). Its prefill chunks
   run meanwhile: a compile overlaps the prefill.
2. `prepare(requests)`, before each sampling step, after the forward pass was launched (so the
   host work overlaps it): every constrained request's matcher is synced to its output and fills
   its mask row; the rows go to the device as one `GrammarMask`. Only the step that samples a
   request's *first constrained* token can wait for its compile, and only if the compile outlasted
   the prefill (cold cache and a short prompt; llguidance compiles typical schemas in about a
   millisecond): waiting there keeps the prefill overlapped and needs no scheduler state. A compile
   that fails or times out fails the request; it never runs unconstrained. A CPU engine's forward
   blocks the host, so there the rows were filled ahead by `advance` (`engine.grammar.fill_ahead`)
   and `prepare` fills only those that moved. When the step samples exactly the requests that
   `advance` kept going, in the same order (the steady decode batch), `prepare` takes that list
   as it is: nothing touched a matcher in between (everything else here that does drops it).
3. `advance(requests)`, once the step's tokens are known on the host: each matcher consumes its
   new token (the usual one new token a row in one backend call, `accept_tokens`); a grammar with
   nothing left but an end token finishes its request as `stop` (over `min_tokens` and
   `ignore_eos`: the grammar wins), a rejected token fails it (a bug the mask should make
   impossible). A CPU engine then starts filling the next step's rows.
4. Decode role: `accept_first_token` takes over from the prefill pod, which sampled token 0 under
   the same grammar: the fingerprints must match and the token must be accepted, or the pod
   prefills locally (`FirstTokenRejected`). The matcher syncs to output positions, so token 0 is
   accepted exactly once whatever happens next (preemption, recompute).

Free rows are untouched: no mask row, no copy, no kernel work. Tensor parallelism: only rank 0
samples, so all of this lives on rank 0 (the other ranks never see a grammar).
"""

from __future__ import annotations

import concurrent.futures
from operator import is_
from typing import Callable, Sequence

import numpy as np
import torch

from engine.grammar.backend import ACCEPTED, TERMINATED, GrammarBackend, GrammarCompileError, GrammarError
from engine.grammar.compiler import GrammarCompiler
from engine.grammar.fill_ahead import FillAhead
from engine.grammar.mask import BitmaskBuffers, GrammarMask
from engine.grammar.request_grammar import RequestGrammar
from engine.grammar.stats import StructuredStats
from engine.grammar.spec import StructuredSpec
from engine.request import Request
from engine.scheduling.output import PLACEHOLDER_TOKEN_ID
from engine.tokenizer import Tokenizer
from kernels.grammar_mask_host import grammar_mask_bounds

DEFAULT_COMPILE_TIMEOUT_SECONDS = 30.0


class FirstTokenRejected(Exception):
    """Decode role: the prefill pod's first token cannot continue here (`reason`: "fingerprint"
    when the two pods' grammars differ, "token" when this grammar rejects it); prefill locally."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class StructuredOutputs:
    def __init__(self, make_backend: Callable[[], GrammarBackend] | None, vocab_width: int,
                 eos_token_ids: Sequence[int], device: torch.device,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_SECONDS) -> None:
        """`make_backend` None: no tokenizer, so no grammar can compile (requests are refused)."""
        self.compiler = None if make_backend is None else GrammarCompiler(make_backend)
        self.vocab_width = vocab_width
        self.compile_timeout_s = compile_timeout_s
        self.states: dict[str, RequestGrammar] = {}
        self._buffers = BitmaskBuffers((vocab_width + 31) // 32, device, vocab_width=vocab_width)
        end_words = np.zeros((vocab_width + 31) // 32, dtype=np.uint32)   # the eos bits of a row
        for token_id in eos_token_ids:
            if 0 <= token_id < vocab_width:
                end_words[token_id // 32] |= np.uint32(1 << (token_id % 32))
        self._not_end = ~end_words.view(np.int32)
        self._stats = StructuredStats()
        # A CPU engine's forward pass blocks the host: masks are filled beside it on a thread.
        self._ahead = FillAhead() if device.type == "cpu" else None
        # The last `advance`'s going requests, their states and the mask rows under min_tokens:
        # the next `prepare`'s rows if it samples just those (dropped by anything that touches a
        # matcher in between).
        self._going: _Going | None = None

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer | None, vocab_width: int, eos_token_ids: Sequence[int],
                      device: torch.device) -> StructuredOutputs:
        """The default: llguidance over the model's own tokenizer (none without a tokenizer)."""
        def make_backend() -> GrammarBackend:
            from engine.grammar.llguidance_backend import LLGuidanceBackend
            return LLGuidanceBackend(tokenizer, vocab_width, eos_token_ids)
        return cls(make_backend if tokenizer is not None else None, vocab_width, eos_token_ids, device)

    @property
    def available(self) -> bool:
        return self.compiler is not None

    # ------------------------------------------------------------------ life cycle
    def add(self, request: Request) -> None:
        """Start tracking a request with a spec (and its compile)."""
        spec = request.sampling_params.structured
        if spec is None:
            return
        if self.compiler is None:
            raise GrammarCompileError("structured outputs need the model's tokenizer (tokenizer.json)")
        self.states[request.request_id] = RequestGrammar(spec, self.compiler.compile(spec))
        self._stats.requests[spec.kind] += 1

    def forget(self, request_ids: Sequence[str]) -> None:
        states = self.states
        if states:
            self._going = None
            for request_id in request_ids:
                states.pop(request_id, None)

    def reset(self, request_id: str) -> None:
        """The request's output is gone (a local prefill after a refused handoff): start over."""
        self._going = None
        state = self.states.get(request_id)
        if state is not None:
            state.reset()

    def fingerprint(self, spec: StructuredSpec) -> str:
        return self.compiler.fingerprint(spec) if self.compiler is not None else ""

    def compile_future(self, spec: StructuredSpec) -> concurrent.futures.Future:
        """The compile of `spec` (thread-safe: pods start it as a request arrives)."""
        if self.compiler is None:
            raise GrammarCompileError("structured outputs need the model's tokenizer (tokenizer.json)")
        return self.compiler.compile(spec)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
        if self.compiler is not None:
            self.compiler.close()

    # ------------------------------------------------------------------ a step
    def prepare(self, requests: Sequence[Request]) -> tuple[GrammarMask | None, list[tuple[Request, Exception]]]:
        """The masks of a sampling step (`requests[i]` samples row `i`), and the requests that
        must fail instead (their rows are left free: the engine aborts them before `update`)."""
        if not self.states:
            return None, []
        ahead = self._ahead
        if ahead is not None:
            ahead.wait()
        going, self._going = self._going, None
        steady = going is not None and len(going.requests) == len(requests) and all(map(is_, going.requests, requests))
        if steady:
            grammars, short = going.states, going.short    # synced, constrained, started: row j is going's j
            rows: Sequence[int] = range(len(grammars))
            failed: list[tuple[Request, Exception]] = []
        else:
            rows, grammars, short, failed = self._rows(requests)
        if not grammars:
            return None, failed
        num_rows = len(grammars)
        host = self._buffers.host_rows(num_rows)
        bounds = self._buffers.bounds_rows(num_rows)
        stale = (list(zip([state.matcher for state in grammars], range(num_rows))) if ahead is None
                 else ahead.stale(grammars, untouched=steady))
        if stale:
            self.compiler.backend.fill_bitmask(stale, host)
            if bounds is not None:
                grammar_mask_bounds(host, bounds)
        end_only = frozenset(rows[j] for j in short if not (host[j] & self._not_end).any())
        return self._buffers.upload(num_rows, rows, end_only), failed

    def _rows(self, requests: Sequence[Request]) -> tuple[list[int], list[RequestGrammar], list[int],
                                                         list[tuple[Request, Exception]]]:
        """`prepare`'s rows, request by request: (the sampler row of each mask row, the grammar of
        each mask row, the mask rows still under their min_tokens, the requests that must fail)."""
        states = self.states
        failed: list[tuple[Request, Exception]] = []
        rows: list[int] = []
        grammars: list[RequestGrammar] = []
        short: list[int] = []
        for row, request in enumerate(requests):
            state = states.get(request.request_id)
            if state is None or request.is_finished:   # finished: a row whose token is dropped
                continue
            output = request.output_token_ids
            # Usually `advance` already synced the matcher to this output: nothing to do but fill.
            if state.matcher is None or state.num_seen != len(output) or state.error:
                error = self._sync(state, request)
                if error is not None:
                    failed.append((request, error))
                    continue
            if state.constrained:
                if len(output) < request.sampling_params.min_tokens:
                    short.append(len(grammars))
                rows.append(row)
                grammars.append(state)
        return rows, grammars, short, failed

    def _sync(self, state: RequestGrammar, request: Request) -> Exception | None:
        """Bring `state` up to the request's output, starting its matcher (which may wait for the
        compile) once the output is constrained. Returns the error that ends the request."""
        if not state.sync(request.output_token_ids):
            return GrammarError(f"structured output: {state.error}")
        if state.constrained and state.matcher is None:
            try:
                state.start(state.future.result(timeout=self.compile_timeout_s))
            except concurrent.futures.TimeoutError:
                return GrammarCompileError(
                    f"structured output ({state.spec.kind}) did not compile within {self.compile_timeout_s:g} s")
            except GrammarCompileError as e:
                return e
            if not state.sync(request.output_token_ids):
                return GrammarError(f"structured output: {state.error}")
        return None

    def advance(self, requests: Sequence[Request]) -> tuple[list[Request], list[tuple[Request, Exception]]]:
        """After the step's tokens are on the host: (requests whose grammar is complete, requests
        that must fail). Finished requests are skipped. A CPU engine then starts filling the next
        step's rows, in this order (`engine.grammar.fill_ahead`)."""
        states = self.states
        if not states:
            return [], []
        ahead = self._ahead
        if ahead is not None:
            ahead.wait()
        self._going = None
        done: list[Request] = []
        failed: list[tuple[Request, Exception]] = []
        going = _Going()                        # constrained, and on to the next step
        pairs: list = []                        # the usual rows, (matcher, token), for one backend call
        waiting: list[tuple[Request, RequestGrammar]] = []      # their requests and states
        for request in requests:
            state = states.get(request.request_id)
            if state is None or request.is_finished:
                continue
            output = request.output_token_ids
            matcher = state.matcher
            # The usual row: constrained (a decode pod starts a matcher at the handoff, before a
            # marker the output has not reached yet: `sync` looks for it), one token behind.
            if matcher is not None and state.constrain_from is not None and state.num_seen == len(output) - 1 \
                    and not state.error and output[-1] != PLACEHOLDER_TOKEN_ID:
                pairs.append((matcher, output[-1]))
                waiting.append((request, state))
                continue
            if pairs:       # those before this row first: `going` stays in batch order
                self._accept(pairs, waiting, done, failed, going)
            if not state.sync(output):
                failed.append((request, GrammarError(f"structured output: {state.error}")))
            elif state.is_terminated():
                done.append(request)
            elif state.matcher is not None and state.constrained:   # `going` is the next prepare's mask rows
                going.add(request, state)
        if pairs:
            self._accept(pairs, waiting, done, failed, going)
        if going.states:
            self._going = going
            if ahead is not None:
                num_rows = len(going.states)
                ahead.start(self.compiler.backend, going.states, self._buffers.host_rows(num_rows),
                            self._buffers.bounds_rows(num_rows))
        return done, failed

    def _accept(self, pairs: list, waiting: list[tuple[Request, RequestGrammar]], done: list[Request],
                failed: list[tuple[Request, Exception]], going: _Going) -> None:
        """`advance`'s usual rows (each matcher one token behind its output): one backend call,
        then each row as `RequestGrammar.sync` + `is_terminated` would have it. Empties `pairs`
        and `waiting`."""
        results = self.compiler.backend.accept_tokens(pairs)
        for (request, state), (matcher, token), result in zip(waiting, pairs, results):
            state.num_seen += 1
            if result == ACCEPTED:
                going.add(request, state)
            elif result == TERMINATED:
                done.append(request)
            else:
                state.error = matcher.error or f"output token {token} rejected"
                failed.append((request, GrammarError(f"structured output: {state.error}")))
        pairs.clear()
        waiting.clear()

    # ------------------------------------------------------------------ decode role
    def accept_first_token(self, request: Request, token_id: int, fingerprint: str) -> None:
        """The prefill pod sampled `token_id` under a grammar named `fingerprint`: continue from
        it, or raise `FirstTokenRejected` (nothing changed: prefill locally) or
        `GrammarCompileError` (this pod cannot compile the spec: fail). The compile must be done
        (a decode pod awaits `compile_future` before it lands the KV)."""
        self._going = None
        state = self.states.get(request.request_id)
        if state is None:
            return
        try:
            compiled = state.future.result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarCompileError(f"structured output ({state.spec.kind}) did not compile within "
                                      f"{self.compile_timeout_s:g} s") from None
        ours = self.compiler.fingerprint(state.spec)
        if fingerprint != ours:
            self._stats.first_token_rejected["fingerprint"] += 1
            raise FirstTokenRejected("fingerprint", f"the prefill pod's grammar {fingerprint[:12] or '(none)'} "
                                                    f"is not this pod's {ours[:12]}")
        if state.matcher is None:
            state.start(compiled)
        if not state.sync([token_id]):
            error = state.error
            state.reset()
            self._stats.first_token_rejected["token"] += 1
            raise FirstTokenRejected("token", f"the grammar rejects the prefill pod's first token: {error}")

    # ------------------------------------------------------------------ metrics
    def take_stats(self) -> StructuredStats:
        stats, self._stats = self._stats, StructuredStats()
        if self.compiler is not None:
            stats.compile = self.compiler.take_stats()
        return stats


class _Going:
    """`advance`'s constrained requests that go on to the next step, in batch order: the next
    `prepare`'s mask rows when that step samples exactly these requests (the steady batch)."""

    __slots__ = ("requests", "states", "short")

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.states: list[RequestGrammar] = []
        self.short: list[int] = []          # rows still under their min_tokens

    def add(self, request: Request, state: RequestGrammar) -> None:
        if len(request.output_token_ids) < request.sampling_params.min_tokens:
            self.short.append(len(self.states))
        self.requests.append(request)
        self.states.append(state)
