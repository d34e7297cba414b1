"""`StepStats`: an engine's record of its own steps, and the `EngineStats` snapshot pods report.

Each step leaves a `StepSample` (batch size, context tokens, prefill tokens, seconds) for the
router's step-time model, an EWMA of step seconds (its fallback before the model is fitted) and an
EWMA of prefill tokens per second (its TTFT predictor's rate). The engine records its measured
steps here; the capacity planner records its simulated ones, so the router sees both alike.

With `CBSERVE_STEP_TRACE=DIR` in its environment, an engine also writes every step to
`DIR/steps-<role>-<pid>-<n>.jsonl` (`StepTrace`): when it ended, its seconds, the engine thread's CPU
seconds so far and its `StepShape`, which `bench/step_check.py` holds against a profile's step
costs step by step (a diagnostic: one line written per step).
"""

from __future__ import annotations

import itertools
import json
import operator
import os
import time
from collections import deque

from engine.outputs import EngineStats, StepSample
from engine.scheduling.output import DecodeSeqs, SchedulerOutput
from engine.scheduling.state import SchedulerState
from engine.telemetry.step_shape import StepShape

EWMA_ALPHA = 0.1
STEP_TRACE_ENV = "CBSERVE_STEP_TRACE"
_START = operator.itemgetter(2)      # ScheduledSeq.start_position (a NamedTuple: C-level read)


class StepTrace:
    """Every step of one engine, a JSON line each: [unix time at its end, seconds, the engine
    thread's CPU seconds so far, `StepShape.to_json()`]; line-buffered, so a killed pod leaves
    whole lines."""

    _numbers = itertools.count()

    def __init__(self, directory: str, role: str) -> None:
        os.makedirs(directory, exist_ok=True)
        name = f"steps-{role}-{os.getpid()}-{next(self._numbers)}.jsonl"
        self.path = os.path.join(directory, name)
        self._file = open(self.path, "a", buffering=1)

    @classmethod
    def from_env(cls, role: str) -> StepTrace | None:
        directory = os.environ.get(STEP_TRACE_ENV)
        return cls(directory, role) if directory else None

    def write(self, out: SchedulerOutput, seconds: float) -> None:
        line = [round(time.time(), 6), round(seconds, 7), round(time.thread_time(), 6), StepShape.of(out).to_json()]
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


class StepStats:
    """Recent step samples and the two EWMAs; `record` once per step that scheduled work."""

    def __init__(self, max_samples: int = 256, trace: StepTrace | None = None) -> None:
        self.samples: deque[StepSample] = deque(maxlen=max_samples)
        self.step_seconds_ewma = 0.0
        self.prefill_tokens_per_second = 0.0
        self.num_steps = 0
        self.trace = trace

    def record(self, out: SchedulerOutput, seconds: float) -> None:
        # Once per step on the engine thread: decode-only steps skip the prefill sum, the context
        # is summed at C level.
        seqs = out.scheduled
        num_prefill = 0 if out.num_batched_tokens == len(seqs) else sum(
            len(s.token_ids) for s in seqs if len(s.token_ids) > 1 and not s.sample > 1)   # (drafts: not prefill)
        starts = seqs.starts if isinstance(seqs, DecodeSeqs) else None    # columns (engine.decode_columns)
        context = (sum(map(_START, seqs)) if starts is None else int(starts.sum())) + out.num_batched_tokens
        self.samples.append(StepSample(len(seqs), context, num_prefill, seconds))
        alpha = EWMA_ALPHA
        self.step_seconds_ewma = seconds if self.num_steps == 0 else (
            (1 - alpha) * self.step_seconds_ewma + alpha * seconds)
        if self.trace is not None:
            self.trace.write(out, seconds)
        if num_prefill:
            rate = out.num_batched_tokens / seconds
            self.prefill_tokens_per_second = rate if self.prefill_tokens_per_second == 0 else (
                (1 - alpha) * self.prefill_tokens_per_second + alpha * rate)
        self.num_steps += 1

    def close(self) -> None:
        """Close the step trace, if any (a step recorded after is not written)."""
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    def reset(self) -> None:
        """Forget step timings (after a warm-up whose first step includes one-off costs)."""
        self.step_seconds_ewma = self.prefill_tokens_per_second = 0.0
        self.num_steps = 0
        self.samples.clear()

    def snapshot(self, scheduler: SchedulerState, lora_adapters: tuple = (), max_loras: int = 0,
                 spec_decode=None) -> EngineStats:
        """The engine's statistics now: the scheduler's queues and pool, these timings, and the
        LoRA adapters' (`engine.lora.stats`; none without LoRA) and speculative decoding's counts
        (`engine.spec_decode.stats`; None without it)."""
        pool = scheduler.kv_manager.block_pool
        return EngineStats(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            prefill_queue_tokens=scheduler.prefill_queue_tokens, num_free_blocks=pool.num_free_blocks,
            num_total_blocks=pool.num_usable_blocks, kv_cache_usage=pool.usage,
            prefix_cache_hit_ratio=scheduler.kv_manager.hit_ratio, num_preemptions=scheduler.num_preemptions,
            step_seconds_ewma=self.step_seconds_ewma, prefill_tokens_per_second=self.prefill_tokens_per_second,
            num_steps=self.num_steps, lora_adapters=lora_adapters, max_loras=max_loras,
            spec_decode=spec_decode)
