"""One request object end to end: the scheduler, block manager, runner and pods all read this.

"In prefill" is not a separate type or phase: it means `num_computed_tokens < num_prompt_tokens`
(more exactly, fewer tokens computed than `num_tokens - 1`, after a preemption by recompute).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.lora.request import LoRARequest
from engine.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"                        # queued, nothing computed (or preempted)
    WAITING_FOR_BLOCKS = "waiting_for_blocks"  # decode role: queued until its prompt's blocks are reserved
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # decode role: blocks reserved, KV being pulled
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"      # stop token / stop string / eos
    FINISHED_LENGTH = "finished_length"        # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_PREFILLED = "finished_prefilled"  # prefill role: first token sampled, KV handed off
    FINISHED_GRAMMAR = "finished_grammar"      # structured output complete: its grammar allows no more

    # Set on every member below: `is_finished: bool` and `finish_reason: str | None`. Plain member
    # attributes, not properties: the engine reads them for every request every step.
    is_finished: bool
    finish_reason: str | None


_FINISH_REASONS = {"finished_stopped": "stop", "finished_length": "length", "finished_aborted": "abort",
                   "finished_prefilled": "prefilled", "finished_grammar": "stop"}
for _status in RequestStatus:
    _status.is_finished = _status.value.startswith("finished")
    _status.finish_reason = _FINISH_REASONS.get(_status.value)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value is served first under the `priority` policy
    lora: LoRARequest | None = None   # its LoRA adapter (engine/lora/), None: the base model

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # prompt + output; the KV of token_ids[:num_computed_tokens] is in the cache.
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0      # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Prompt logprobs still to compute (engine/prompt_logprobs/): every prompt token must run
    # through the model, so a prefix-cache hit would skip exactly the work this request asked for.
    skip_reading_prefix_cache: bool = False

    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
