"""What the engine hands back: per-request deltas each step, and engine-wide statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # torch-free at run time: the capacity planner builds these without torch
    from engine.prompt_logprobs import PromptLogprobs
    from engine.sampling.sampler import TokenLogprobs
    from engine.spec_decode.stats import SpecDecodeStats


@dataclass(slots=True)
class RequestOutput:
    """The tokens a request gained in one step (and everything so far, for offline use). Slots:
    one is built per request per step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    text_delta: str
    finished: bool
    finish_reason: str | None          # "stop" | "length" | "abort" | "prefilled"
    num_prompt_tokens: int
    num_cached_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    first_token_time: float | None = None
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    stop_reason: int | str | None = None
    grammar_fingerprint: str = ""      # prefill role: the grammar the first token was sampled under
    prompt_logprobs: PromptLogprobs | None = None   # on a request's first output, when it asked


@dataclass(frozen=True)
class StepSample:
    """One engine step, for the router's step-time model: (batch, context tokens) -> seconds."""

    num_seqs: int
    num_context_tokens: int
    num_prefill_tokens: int
    seconds: float


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    prefill_queue_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_hit_ratio: float
    num_preemptions: int
    step_seconds_ewma: float
    prefill_tokens_per_second: float
    num_steps: int
    spec_decode: SpecDecodeStats | None = None    # speculative decoding's counts (None: not speculating)
    lora_adapters: tuple = ()          # engine.lora.stats.LoRAAdapterStats, by name (LoRA enabled)
    max_loras: int = 0                 # adapters one batch can hold (0: LoRA disabled)
