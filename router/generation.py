"""One HTTP request's choices running on the pods, turned into text events.

Each choice (prompt x n) is a `Choice`: `start()` routes it and waits for its first tokens
(`Dispatcher.start`, retries included); `events()` turns its pod messages into text with the same
`IncrementalDetokenizer` the decode pod uses (so both agree on where a stop string cuts), one
`update` per pod message (a message carries every token of one engine step), and records the
choice's latency metrics at its end. `RequestRun.prime()` starts every choice and waits for all
first tokens, so admission errors (429, 503) and routing failures become a proper HTTP status even
for streaming requests, before any header is sent. A non-streaming request's choice whose pod is
lost after its first tokens runs again on other pods: its client has seen nothing yet.

With one choice, `RequestRun.events()` is that choice's own generator: the task that writes the
HTTP response reads the pod's stream itself, with no task or queue in between. With several, each
choice runs in its own task and their events meet in one queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import NamedTuple

from wire import cbserve_pb2 as pb
from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from router.dispatch import Dispatcher, PodLost, SequenceSpec, SequenceStream, SequenceTrace
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)


class ChoiceEvent(NamedTuple):
    """New text of choice `index` (from one pod message); `finish_reason` is set on its last event."""

    index: int
    text: str
    token_ids: Sequence[int]
    logprobs: Sequence[pb.TokenLogprobs]
    finish_reason: str | None = None
    prompt_logprobs: pb.PromptLogprobs | None = None   # on a choice's first event, when asked


class Choice:
    """One output sequence of a request: its pod stream as text events, and its metrics."""

    def __init__(self, index: int, spec: SequenceSpec, dispatcher: Dispatcher, tokenizer: Tokenizer,
                 metrics: RouterMetrics, arrival: float, replayable: bool = False) -> None:
        self.index = index
        self.spec = spec
        # Non-streaming: nothing reaches the client before the end, so a sequence whose pod is lost
        # after its first tokens runs again elsewhere, up to `max_retries` times (`events`).
        self.replays_left = dispatcher.max_retries if replayable else 0
        self._attempt_spec = spec       # the spec of the current run (a replay has its own id)
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.arrival = arrival                  # monotonic seconds the HTTP request arrived
        self.trace = SequenceTrace()
        self.stream: SequenceStream | None = None

    @property
    def num_output_tokens(self) -> int:
        """Tokens the pods produced for this choice so far (deduplicated; usage counts these)."""
        return self.stream.next_index if self.stream is not None else 0

    async def start(self) -> None:
        """Route the choice and wait for its first tokens; raises APIError if it cannot be served."""
        self.stream = await self.dispatcher.start(self._attempt_spec, self.trace)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Text events, one per pod message, until the one with `finish_reason`. Needs `start()`.

        A replayable choice yields nothing until its sequence has finished: if a pod is lost on
        the way (`PodLost`), the events so far are dropped and the sequence runs again on other
        pods; the client, which has seen nothing yet, gets one whole answer."""
        if not self.replays_left:
            async for event in self._events():
                yield event
            return
        while True:
            buffered = []
            try:
                async for event in self._events():
                    buffered.append(event)
            except PodLost as lost:
                if not self.replays_left:
                    raise
                await self._replay(lost)
                continue
            for event in buffered:
                yield event
            return

    async def _replay(self, lost: PodLost) -> None:
        """Run the sequence again from the start, away from the pod that failed it."""
        self.replays_left -= 1
        self.metrics.retries.inc()
        failed = lost.failure.pod.address
        log.warning("request %s: %s after its first tokens; nothing reached the client, running it again "
                    "elsewhere", self.spec.request_id, lost.failure)
        routing = replace(self._attempt_spec.routing, exclude=self._attempt_spec.routing.exclude | {failed},
                          slo_ttft_seconds=float("inf"), slo_tpot_seconds=float("inf"))
        replays = self.dispatcher.max_retries - self.replays_left
        self._attempt_spec = replace(self.spec, request_id=f"{self.spec.request_id}-replay{replays}",
                                     routing=routing)
        self.trace = SequenceTrace()
        await self.start()

    async def _events(self) -> AsyncIterator[ChoiceEvent]:
        stream, index, params = self.stream, self.index, self.spec.params
        detokenizer = IncrementalDetokenizer(self.tokenizer, self.spec.prompt_token_ids, params)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.tokenizer.eos_token_ids)
        message = stream.first_message
        prompt_logprobs = message.prompt_logprobs if message.HasField("prompt_logprobs") else None
        try:
            while True:
                token_ids = message.token_ids
                finished = message.finished
                stop_terminated = (finished and message.finish_reason == "stop" and len(token_ids) > 0
                                   and token_ids[-1] in stop_ids)
                delta = detokenizer.update(token_ids, stop_terminated)
                if delta.stopped:
                    finish_reason = "stop"     # a stop string: the pod stops too, or is cancelled now
                    text = delta.text
                    break
                if finished:
                    finish_reason = message.finish_reason or "stop"
                    text = delta.text + detokenizer.flush().text
                    break
                yield ChoiceEvent(index, delta.text, token_ids, message.logprobs, None, prompt_logprobs)
                prompt_logprobs = None
                message = await stream.next()
        finally:
            stream.close()
        # Before the last yield: a consumer that stops at the last event never resumes us.
        self._record()
        yield ChoiceEvent(index, text, token_ids, message.logprobs, finish_reason, prompt_logprobs)

    def _record(self) -> None:
        """Client-facing latencies, SLO attainment and the per-phase breakdown of one sequence.

        TPOT is the client's (OpenAI's, vLLM's): the mean gap after the first token, so with P/D it
        includes the wait from P's first token to D's first one; that wait is also its own phase,
        `pd_gap`, to tell a slow hand-over from slow decode steps.
        """
        now = time.monotonic()
        m, spec, trace = self.metrics, self.spec, self.trace
        first_token_at, num_tokens = self.stream.first_token_at, self.num_output_tokens
        e2e = now - self.arrival
        m.e2e.observe(e2e)
        if first_token_at is None:
            return
        ttft = first_token_at - self.arrival
        tpot = (now - first_token_at) / (num_tokens - 1) if num_tokens > 1 else 0.0
        m.ttft.observe(ttft)
        if num_tokens > 1:
            m.tpot.observe(tpot)
        m.observe_phase("decode", now - first_token_at)
        for phase, value in (("prefill_queue", trace.prefill_queue_seconds), ("prefill", trace.prefill_seconds),
                             ("kv_transfer", trace.kv_transfer_seconds),
                             ("decode_queue", trace.decode_queue_seconds), ("pd_gap", trace.pd_gap_seconds)):
            if value is not None:
                m.observe_phase(phase, value)
        if trace.kv_transfer_seconds is not None:
            m.kv_transfer.observe(trace.kv_transfer_seconds)
        ttft_met = ttft <= spec.routing.slo_ttft_seconds
        tpot_met = tpot <= spec.routing.slo_tpot_seconds
        if ttft_met:
            m.slo_met("ttft")
        if tpot_met:
            m.slo_met("tpot")
        if ttft_met and tpot_met:
            m.slo_met("all")
        else:
            log.info("request %s missed its SLO: ttft=%.3fs tpot=%.4fs tokens=%d | router_queue=%.3fs "
                     "prefill_queue=%s prefill=%s kv_transfer=%s decode_queue=%s pd_gap=%s cached=%d "
                     "local_prefill=%s attempts=%s", spec.request_id, ttft, tpot, num_tokens,
                     trace.router_queue_seconds, trace.prefill_queue_seconds, trace.prefill_seconds,
                     trace.kv_transfer_seconds, trace.decode_queue_seconds, trace.pd_gap_seconds,
                     trace.num_cached_tokens, trace.local_prefill, trace.attempts)


class RequestRun:
    """Runs the choices of one HTTP request and merges their events."""

    def __init__(self, dispatcher: Dispatcher, tokenizer: Tokenizer, metrics: RouterMetrics,
                 specs: list[SequenceSpec], arrival: float, replayable: bool = False) -> None:
        """`replayable`: the answer is sent whole at the end (non-streaming), so a choice whose pod
        is lost midway may run again elsewhere (`Choice.events`)."""
        self.metrics = metrics
        self.choices = [Choice(i, spec, dispatcher, tokenizer, metrics, arrival, replayable)
                        for i, spec in enumerate(specs)]
        self._tasks: list[asyncio.Future] = []

    @property
    def num_output_tokens(self) -> list[int]:
        return [choice.num_output_tokens for choice in self.choices]

    async def prime(self) -> None:
        """Start every choice and wait for its first tokens; re-raise the first error (and cancel the rest)."""
        if len(self.choices) == 1:
            await self.choices[0].start()
            return
        self._tasks = [asyncio.ensure_future(choice.start()) for choice in self.choices]
        await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in self._tasks:
            if task.done() and task.exception() is not None:
                self.cancel()
                raise task.exception()

    def events(self) -> AsyncIterator[ChoiceEvent]:
        """All choice events in arrival order; raises a choice's error when it happens. Needs `prime()`."""
        return self.choices[0].events() if len(self.choices) == 1 else self._merged()

    def cancel(self) -> None:
        """Stop every choice: their pod calls are cancelled (and aborted) and the pods released."""
        for task in self._tasks:
            task.cancel()
        for choice in self.choices:
            if choice.stream is not None:
                choice.stream.close()

    async def _merged(self) -> AsyncIterator[ChoiceEvent]:
        queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(_pump(choice, queue)) for choice in self.choices]
        remaining = len(self.choices)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item


async def _pump(choice: Choice, queue: asyncio.Queue) -> None:
    """One choice's events into the request's queue, then None (or its error)."""
    try:
        async for event in choice.events():
            queue.put_nowait(event)
        queue.put_nowait(None)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # handed to the HTTP side, which answers in OpenAI's shape
        queue.put_nowait(exc)
