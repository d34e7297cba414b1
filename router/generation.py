"""One HTTP request's choices running on the pods, turned into text events.

Each choice (prompt x n) runs in its own task: tokens from `Dispatcher.run`, text from the same
`IncrementalDetokenizer` the decode pod uses (so both agree on where a stop string cuts), and its
latency metrics. Events from all choices meet in one queue. `prime()` waits until every choice has
produced its first event or failed, so admission errors (429, 503) and routing failures become a
proper HTTP status even for streaming requests, before any header is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cbserve.pb import cbserve_pb2 as pb
from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from router.dispatch import Dispatcher, SequenceSpec, SequenceTrace
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChoiceEvent:
    """New text of choice `index`; `finish_reason` is set on its last event."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[pb.TokenLogprobs]
    finish_reason: str | None = None


class RequestRun:
    """Runs the sequences of one HTTP request and merges their events."""

    def __init__(self, dispatcher: Dispatcher, tokenizer: Tokenizer, metrics: RouterMetrics,
                 specs: list[SequenceSpec], arrival: float) -> None:
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.specs = specs
        self.arrival = arrival                    # monotonic seconds the HTTP request arrived
        self.num_output_tokens = [0] * len(specs)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffer: list = []
        self._tasks = [asyncio.create_task(self._run_choice(i, spec)) for i, spec in enumerate(specs)]

    async def prime(self) -> None:
        """Wait for each choice's first event; re-raise the first error (and cancel the rest)."""
        started: set[int] = set()
        while len(started) < len(self.specs):
            item = await self._queue.get()
            index, payload = item
            if isinstance(payload, BaseException):
                self.cancel()
                raise payload
            self._buffer.append(item)
            started.add(index)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """All choice events in arrival order; raises a choice's error when it happens."""
        remaining = len(self.specs)
        buffered, self._buffer = self._buffer, []
        for _, payload in buffered:
            if payload is None:
                remaining -= 1
            else:
                yield payload
        while remaining:
            _, payload = await self._queue.get()
            if payload is None:
                remaining -= 1
            elif isinstance(payload, BaseException):
                raise payload
            else:
                yield payload

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def wait_closed(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run_choice(self, index: int, spec: SequenceSpec) -> None:
        try:
            await self._generate(index, spec)
            self._queue.put_nowait((index, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the HTTP side, which answers in OpenAI's shape
            self._queue.put_nowait((index, exc))

    async def _generate(self, index: int, spec: SequenceSpec) -> None:
        params = spec.params
        detokenizer = IncrementalDetokenizer(self.tokenizer, spec.prompt_token_ids, params)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.tokenizer.eos_token_ids)
        trace = SequenceTrace()
        first_token_at: float | None = None
        finish_reason = None
        async with contextlib.aclosing(self.dispatcher.run(spec, trace)) as tokens:
            async for event in tokens:
                if event.token_ids and first_token_at is None:
                    first_token_at = time.monotonic()
                self.num_output_tokens[index] += len(event.token_ids)
                stop_terminated = (event.finished and event.finish_reason == "stop" and bool(event.token_ids)
                                   and event.token_ids[-1] in stop_ids)
                delta = detokenizer.update(event.token_ids, stop_terminated)
                text = delta.text
                if delta.stopped:
                    finish_reason = "stop"     # a stop string: the pod stops too, or is cancelled now
                elif event.finished:
                    text += detokenizer.flush().text
                    finish_reason = event.finish_reason or "stop"
                self._queue.put_nowait((index, ChoiceEvent(index, text, event.token_ids, event.logprobs,
                                                           finish_reason)))
                if finish_reason is not None:
                    break
        self._record(spec, trace, first_token_at, self.num_output_tokens[index])

    def _record(self, spec: SequenceSpec, trace: SequenceTrace, first_token_at: float | None,
                num_tokens: int) -> None:
        """Client-facing latencies, SLO attainment and the per-phase breakdown of one sequence."""
        now = time.monotonic()
        m = self.metrics
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
                             ("decode_queue", trace.decode_queue_seconds)):
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
                     "prefill_queue=%s prefill=%s kv_transfer=%s decode_queue=%s cached=%d local_prefill=%s "
                     "attempts=%s", spec.request_id, ttft, tpot, num_tokens, trace.router_queue_seconds,
                     trace.prefill_queue_seconds, trace.prefill_seconds, trace.kv_transfer_seconds,
                     trace.decode_queue_seconds, trace.num_cached_tokens, trace.local_prefill, trace.attempts)
