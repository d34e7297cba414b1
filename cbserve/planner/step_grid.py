"""Stage A of `cbserve profile`: real engine steps on a grid of shapes, timed on this device.

Every point is produced by the real `Engine` (scheduler, runner, sampler; the pods' own step) from
requests built to give the shape, and timed as the engine times its steps (`Engine.step_samples`):
- decode (B, C): B sequences decoding at context ~C (or at contexts spread evenly up to C). Their
  prompts are block-aligned cuts of one cached prefix plus a short tail, so only B tails are
  prefilled;
- prefill (k x N at P): k sequences computing N tokens each, after a cached prefix of P tokens;
- mixed (B, C, N): B decodes at context C plus one N-token prompt, the colocated pod's usual step.
Each point is measured `repeats` times and keeps the median; the model is fitted on the grid and
judged on held-out points drawn at random inside the same ranges.

On CPU with one torch thread (as `bench/goodput.py`'s pods run) a step is timed in CPU seconds of
the engine thread (`time.thread_time`): on a machine shared with other work, wall time is mostly the time the thread was
not running, which changes from minute to minute; what serving adds on top (two pods on two cores,
the router, the neighbours) is measured in situ (`in_situ.py`) as a contention factor. On CUDA, or with several torch threads, a step is timed in wall
seconds (the device works while the host thread waits; other threads share the work).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.telemetry.step_shape import StepShape

KINDS = ("decode", "prefill", "mixed")
TIMERS = {"thread_time": time.thread_time, "wall": time.perf_counter}


def timer_name(device_type: str, threads: int) -> str:
    """CPU seconds of the engine thread where it does all the work (CPU, one torch thread); wall
    seconds elsewhere (a device works while the host waits; several threads share a step)."""
    return "thread_time" if device_type == "cpu" and threads == 1 else "wall"


def step_timer(device_type: str, threads: int) -> Callable[[], float]:
    return TIMERS[timer_name(device_type, threads)]


@dataclass(frozen=True)
class GridPoint:
    kind: str
    batch: int = 0       # decodes (decode, mixed)
    context: int = 0     # their context (decode, mixed)
    chunk: int = 0       # prefill tokens per sequence (prefill, mixed)
    prior: int = 0       # cached tokens before each chunk (prefill)
    chunks: int = 1      # prefill sequences in the step (prefill)
    spread: bool = False  # decode contexts spread evenly up to `context` instead of all equal

    def __str__(self) -> str:
        if self.kind == "decode":
            return f"decode {self.batch}x{'<=' if self.spread else ''}{self.context}"
        if self.kind == "prefill":
            return f"prefill {self.chunks}x{self.chunk}@{self.prior}"
        return f"mixed {self.batch}x{self.context}+{self.chunk}"


@dataclass(frozen=True)
class Measurement:
    point: GridPoint
    shape: StepShape         # the step's shape (the same in every repeat)
    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def to_json(self) -> dict:
        return {"point": str(self.point), "shape": self.shape.to_json(), "seconds": list(self.seconds)}

    @classmethod
    def from_json(cls, value: dict) -> Measurement:
        return cls(GridPoint("stored"), StepShape.from_json(value["shape"]), tuple(value["seconds"]))


@dataclass(frozen=True)
class GridLimits:
    """The ranges a profile covers (from the engine's flags and the workloads it will plan)."""

    max_batch: int           # <= max_num_seqs
    max_context: int         # < max_model_len
    max_chunk: int           # <= max_num_batched_tokens
    block_size: int = 16


def grid(limits: GridLimits, quick: bool) -> list[GridPoint]:
    """The fit grid: batch sizes in powers of two, contexts and chunks spread over their ranges."""
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= limits.max_batch]
    if batches[-1] != limits.max_batch:
        batches.append(limits.max_batch)
    contexts = sorted({c for c in (32, 256, 1024, limits.max_context) if c <= limits.max_context})
    if quick:
        contexts = sorted({contexts[0], contexts[len(contexts) // 2], contexts[-1]})
    chunks = sorted({n for n in (16, 64, 128, 256, 512, 1024, 2048, limits.max_chunk) if n <= limits.max_chunk})
    priors = sorted({p for p in (0, 512, limits.max_context // 2) if p + limits.max_chunk < limits.max_context + 1})
    points = [GridPoint("decode", batch=b, context=c) for c in contexts for b in batches]
    points += [GridPoint("decode", batch=b, context=contexts[-1], spread=True) for b in batches if b >= 4]
    points += [GridPoint("prefill", chunk=n, prior=_blocks(p, limits)) for p in priors for n in chunks
               if n + p <= limits.max_context]
    points += [GridPoint("prefill", chunk=n, chunks=k) for k in (2, 4) for n in chunks if k * n <= limits.max_chunk
               and n >= 32]
    mixed_batches = sorted({batches[len(batches) // 3], batches[(2 * len(batches)) // 3]})
    mixed_chunks = sorted({chunks[len(chunks) // 3], chunks[(2 * len(chunks)) // 3]})
    points += [GridPoint("mixed", batch=b, context=contexts[len(contexts) // 2], chunk=n)
               for b in mixed_batches for n in mixed_chunks if b + n <= limits.max_chunk]
    return points


def held_out(limits: GridLimits, count: int, seed: int = 1) -> list[GridPoint]:
    """`count` points drawn at random inside the grid's ranges, one kind in turn."""
    rng = random.Random(seed)
    points = []
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        if kind == "decode":
            points.append(GridPoint("decode", batch=rng.randint(1, limits.max_batch),
                                    context=rng.randint(32, limits.max_context), spread=i % 2 == 1))
        elif kind == "prefill":
            chunk = rng.randint(16, limits.max_chunk)
            prior = _blocks(rng.randint(0, max(0, limits.max_context - chunk)), limits)
            points.append(GridPoint("prefill", chunk=chunk, prior=prior))
        else:
            batch = rng.randint(1, max(1, min(limits.max_batch, limits.max_chunk // 2)))
            points.append(GridPoint("mixed", batch=batch, context=rng.randint(32, limits.max_context),
                                    chunk=rng.randint(16, max(16, limits.max_chunk - batch))))
    return points


def _blocks(tokens: int, limits: GridLimits) -> int:
    return tokens // limits.block_size * limits.block_size


class StepGrid:
    """Produces and times grid points on one engine (colocated role, prefix caching on)."""

    def __init__(self, engine, repeats: int, max_context: int, seed: int = 0,
                 timer: Callable[[], float] | None = None) -> None:
        from engine.sampling.params import SamplingParams

        self.engine = engine
        self.timer = timer or step_timer(engine.device.type, 1)
        self.repeats = repeats
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.vocab_size
        self.block_size = engine.cache_config.block_size
        self.max_context = max_context
        self.params = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        # One shared prompt: every request starts with a block-aligned cut of it, so the prefix cache
        # serves what an earlier point computed and each point prefills little beyond its own shape.
        self._shared = self._tokens(max_context)
        self._warmed = 0                             # its longest cut computed (so cached) so far

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def _step(self) -> tuple[StepShape, float] | None:
        engine, timer = self.engine, self.timer
        start = timer()
        engine.step()
        seconds = timer() - start
        out = engine.last_schedule
        if out is None or not out.scheduled:
            return None
        return StepShape.of(out), seconds

    def _clear(self) -> None:
        for request_id in list(self.engine.scheduler.requests):
            self.engine.abort(request_id)

    def _start_decodes(self, batch: int, context: int, max_tokens: int, spread: bool = False) -> None:
        """`batch` requests of `context` prompt tokens (or lengths spread evenly up to it), each a
        block-aligned cut of one shared prefix plus its own tail, run until every one is decoding."""
        bs, shared = self.block_size, self._shared
        lengths = [max(2, round(context * (i + 1) / batch)) if spread else context for i in range(batch)]
        self._warm_prefix(max(lengths) - 1)
        # Until the last tail is computed, the first admitted ones decode already: give them the tokens.
        max_tokens += -(-sum(min(bs, n) for n in lengths) // self.engine.scheduler_config.max_num_batched_tokens)
        for length in lengths:
            cut = (length - 1) // bs * bs
            self.engine.add_request(shared[:cut] + self._tokens(length - cut), self.params(max_tokens))
        scheduler = self.engine.scheduler
        while scheduler.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in scheduler.running):
            self._step()

    def _warm_prefix(self, prior: int) -> list[int]:
        """The shared prompt's first `prior` tokens, cached (one request computes them if needed)."""
        prior = prior // self.block_size * self.block_size
        prefix = self._shared[:prior]
        if prior > self._warmed:
            self.engine.add_request(prefix + self._tokens(self.block_size), self.params(1))
            while self.engine.has_unfinished_requests():
                self._step()
            self._warmed = prior
        return prefix

    def measure(self, point: GridPoint) -> Measurement:
        engine, samples = self.engine, []
        want = None
        if point.kind == "decode":
            self._start_decodes(point.batch, point.context, self.repeats + 2, point.spread)
            while len(samples) < self.repeats and engine.has_unfinished_requests():
                step = self._step()
                if step and step[0].num_decodes == point.batch and not step[0].prefill_chunks:
                    samples.append(step)
        elif point.kind == "prefill":
            prefix = self._warm_prefix(point.prior)
            for _ in range(self.repeats):
                for _ in range(point.chunks):
                    engine.add_request(prefix + self._tokens(point.chunk), self.params(1))
                step = self._step()
                want = (point.chunks, point.chunk)
                if step and len(step[0].prefill_chunks) == point.chunks and not step[0].num_decodes:
                    samples.append(step)
                while engine.has_unfinished_requests():
                    self._step()
        else:
            self._start_decodes(point.batch, point.context, 10 * self.repeats + 10)
            for _ in range(self.repeats):
                engine.add_request(self._tokens(point.chunk), self.params(1))
                step = self._step()
                if step and step[0].num_decodes == point.batch and len(step[0].prefill_chunks) == 1:
                    samples.append(step)
        self._clear()
        if not samples:
            raise RuntimeError(f"grid point {point} gave no step of its shape (budget {want}?)")
        shapes = [s for s, _ in samples]
        # The decodes' context grows by one per repeat: keep the middle repeat's shape.
        return Measurement(point, shapes[len(shapes) // 2], tuple(t for _, t in samples))
