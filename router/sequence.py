"""One output sequence as the router runs it: what to generate (`SequenceSpec`) and what happened
to it (`SequenceTrace`). The plain values `router.dispatch` (admit, route, retry) and
`router.pod_stream` (one attempt's pod calls) share, so neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wire import cbserve_pb2 as pb
from engine.sampling.params import SamplingParams
from router.policy.base import RoutingRequest


@dataclass(frozen=True)
class SequenceSpec:
    """One output sequence to generate (a request with n=2 has two)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    routing: RoutingRequest
    arrival_time: float          # unix seconds at the router
    deadline: float              # monotonic seconds; every RPC's timeout counts down to it
    priority: int = 0
    lora_name: str = ""          # LoRA adapter ("" = the base model)


@dataclass
class SequenceTrace:
    """What happened to one sequence, for metrics and for explaining a slow request."""

    router_queue_seconds: float = 0.0
    prefill_queue_seconds: float | None = None
    prefill_seconds: float | None = None
    kv_transfer_seconds: float | None = None
    decode_queue_seconds: float | None = None
    pd_gap_seconds: float | None = None    # P's first token to D's first token, as the router saw them
    num_cached_tokens: int = 0
    local_prefill: bool = False
    attempts: list[str] = field(default_factory=list)   # "P@addr+D@addr" per attempt

    def record_generate(self, item: pb.GenerateResponse) -> None:
        """The decode pod's first message says how the KV got there and how long it queued."""
        self.local_prefill = item.local_prefill
        if item.local_prefill:
            self.prefill_queue_seconds = item.queue_seconds
            self.num_cached_tokens = item.num_cached_tokens
        else:
            self.kv_transfer_seconds = item.kv_transfer_seconds
            self.decode_queue_seconds = item.queue_seconds
