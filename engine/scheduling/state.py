"""What a scheduler tracks between steps, and every event that is not a step.

`SchedulerState` owns the containers — `requests`, the policy's `waiting` queue, `running`, and
for disaggregation `waiting_for_blocks` / `waiting_for_remote_kv` (decode role) and `held`
(prefill role) — and the edges that move requests between them: intake, endings (finish, abort,
release), the decode role's remote-KV events, queries for metrics, and `check_invariants`.
`engine.scheduling.scheduler.Scheduler` adds the step itself (`schedule` / `update`).

Roles change only the edges (`docs/architecture.md`): `prefill` ends a request after its first
token and keeps its blocks referenced until `release_request`; `decode` reserves a prompt's blocks
before its KV is pulled from a prefill pod (`add_remote_request`, `remote_kv_landed`,
`remote_kv_failed`) and can still prefill locally (`add_request`, and after a failed pull).

Blocks and transfers: a prefill pod streams `request.block_ids[:num_computed_tokens // block_size]`
of every request in `last_progressed` after each `update`; a request in `preempted_request_ids`
lost its blocks (its KV will be recomputed into new ones). Freeing is immediate in
`abort_request`, `release_request` and `remote_kv_failed`, so a pod must stop (or fence) any
transfer that reads or writes those blocks before calling them, or a block reused by another
request could be read stale or overwritten.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from engine.block_pool import BlockPool
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduling.request_queue import FCFSQueue, PriorityQueue
from engine.scheduling.output import SchedulerOutput

ROLES = ("colocated", "prefill", "decode")
_RUNNING = RequestStatus.RUNNING


class SchedulerState:
    """The containers and non-step events of a `Scheduler` (see the module docstring).

    `kv` is either a `CacheConfig` with `num_blocks` set (the scheduler builds its own pool) or a
    ready `KVCacheManager`. `eos_token_ids` end a request unless its `ignore_eos` is set.
    `reserve_watermark` (decode role) is the fraction of blocks kept free, when anything is running
    or reserved, so that running decodes can still grow after remote prompts are reserved.
    `lora_slots` (`engine.lora.slots.LoRASlots`, LoRA enabled): a request with an adapter holds a
    slot from admission (or reservation) until it leaves the batch; none free: it waits.
    `clock` stamps requests' scheduling, token and finish times; the capacity planner passes its
    virtual clock (`cbserve.planner`), so the same scheduler runs on simulated time.
    """

    def __init__(self, scheduler_config: SchedulerConfig, kv: CacheConfig | KVCacheManager,
                 role: str = "colocated", eos_token_ids: Iterable[int] = (),
                 reserve_watermark: float = 0.01, lora_slots=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if isinstance(kv, CacheConfig):
            if kv.num_blocks is None:
                raise ValueError("CacheConfig.num_blocks must be set (dataclasses.replace it once sized)")
            kv = KVCacheManager(BlockPool(kv.num_blocks, kv.enable_prefix_caching), kv.block_size,
                                kv.sliding_window, kv.kv_group_windows[1:])
        if not 0.0 <= reserve_watermark < 1.0:
            raise ValueError(f"reserve_watermark must be in [0, 1), got {reserve_watermark}")
        self.config = scheduler_config
        self.kv_manager = kv
        self.block_size = kv.block_size
        self.role = role
        self.clock = clock
        self.eos_token_ids = frozenset(eos_token_ids)
        self.lora_slots = lora_slots
        self._watermark_blocks = max(1, int(reserve_watermark * kv.block_pool.num_usable_blocks))

        self.requests: dict[str, Request] = {}   # every request this scheduler still tracks
        self.waiting = PriorityQueue() if scheduler_config.policy == "priority" else FCFSQueue()
        self.running: list[Request] = []         # admission order: the newest is last
        self.waiting_for_blocks: deque[Request] = deque()       # decode role, FIFO
        self.waiting_for_remote_kv: dict[str, Request] = {}     # decode role: reserved, pulling
        self.held: dict[str, Request] = {}       # prefill role: FINISHED_PREFILLED, blocks kept
        self._finished_ids: list[str] = []       # since the last schedule()
        self._pending_output: SchedulerOutput | None = None   # scheduled, not yet update()d
        self._pending_requests: list[Request] = []   # the requests of _pending_output's seqs
        self.num_preemptions = 0
        # Requests whose num_computed_tokens advanced in the last update(): the prefill pod
        # streams each finished chunk's KV from this (a second list rather than a richer return
        # type, so `update` keeps returning just the requests that got a token).
        self.last_progressed: list[Request] = []
        # Steady decode steps as columns: `engine.decode_columns` (above this module) keeps its
        # `DecodeColumns` here, the running batch's and those whose requests the last update returned.
        self._columns = None
        self._resolving = None

    # ------------------------------------------------------------------ intake
    def add_request(self, request: Request) -> None:
        """Queue a request to be prefilled here (any role)."""
        self._admit_check(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def add_remote_request(self, request: Request) -> None:
        """Decode role: queue a request whose prompt KV will be pulled from a prefill pod."""
        if self.role != "decode":
            raise ValueError(f"add_remote_request needs role 'decode', this scheduler is {self.role!r}")
        self._admit_check(request)
        request.status = RequestStatus.WAITING_FOR_BLOCKS
        self.requests[request.request_id] = request
        self.waiting_for_blocks.append(request)

    def _admit_check(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already scheduled")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.block_ids or request.num_computed_tokens or request.output_token_ids:
            raise ValueError(f"request {request.request_id!r} must be fresh (no blocks, nothing computed)")
        max_len = request.num_prompt_tokens + request.sampling_params.max_tokens
        if max_len > self.config.max_model_len:
            raise ValueError(f"request {request.request_id!r}: prompt ({request.num_prompt_tokens}) + "
                             f"max_tokens exceeds max_model_len ({self.config.max_model_len})")
        kv, chunk = self.kv_manager, self.config.max_num_batched_tokens
        # A prefill pod holds the prompt (a window of it, with one) until the pull ends; a decode
        # pod reserves the prompt's last window for its pull, then grows as it decodes.
        max_blocks = kv.max_blocks_held(request.num_prompt_tokens if self.role == "prefill" else max_len, chunk)
        if max_blocks > self.kv_manager.block_pool.num_usable_blocks:
            raise ValueError(f"request {request.request_id!r} needs {max_blocks} KV blocks, the pool has "
                             f"{self.kv_manager.block_pool.num_usable_blocks}")

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Token-level stops; sets status and `stop_reason` when the request must finish.

        Stop tokens (eos, `stop_token_ids`) count only once `min_tokens` tokens exist, the token
        itself included (as in vLLM; the sampler also masks them before that). A placeholder
        (async scheduling) is no stop token, so only the length test can end it here.
        """
        if self._is_stop_token(request, token_id):
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if len(request.output_token_ids) >= request.sampling_params.max_tokens \
                or len(request.token_ids) >= self.config.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _is_stop_token(self, request: Request, token_id: int) -> bool:
        """`token_id` ends the request (eos or a stop token, past min_tokens); sets `stop_reason`
        for a stop token."""
        params = request.sampling_params
        if len(request.output_token_ids) < params.min_tokens:
            return False
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return True
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return True
        return False

    # ------------------------------------------------------------------ async scheduling
    def resolve_placeholders(self, requests: list[Request], token_ids: list[int]) -> list[Request]:
        """Async scheduling: `requests[i]` got a placeholder from `update(out, None)`; its sampled
        token is `token_ids[i]`. Writes the tokens and applies the token stops that update could
        not see (eos, stop tokens). A request that finished on its length meanwhile is relabelled
        "stop" when its last token is a stop token, as the synchronous path would have said.
        Aborted requests are skipped. Returns the requests whose token was written, in order."""
        resolved = []
        eos_ids = self.eos_token_ids
        for request, token_id in zip(requests, token_ids):
            if request.status is RequestStatus.FINISHED_ABORTED:
                continue
            request.output_token_ids[-1] = token_id
            request.token_ids[-1] = token_id
            resolved.append(request)
            if token_id in eos_ids or token_id in request.sampling_params.stop_token_ids:
                self.stop_on_resolved(request, token_id)
        return resolved

    def stop_on_resolved(self, request: Request, token_id: int) -> None:
        """`resolve_placeholders` wrote `token_id`, an eos or stop token of the request: it ends
        there if it counts (`_is_stop_token`); one that ended on its length meanwhile says "stop"."""
        status = request.status
        if not self._is_stop_token(request, token_id):
            return
        if status is RequestStatus.FINISHED_LENGTH:
            request.status = RequestStatus.FINISHED_STOPPED
        elif not status.is_finished:
            self._remove(request, RequestStatus.FINISHED_STOPPED)

    # ------------------------------------------------------------------ endings
    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """End a request for a reason found outside the scheduler (stop strings); frees its blocks.

        Returns False when the request is unknown (already finished or aborted).
        """
        if not status.is_finished or status is RequestStatus.FINISHED_PREFILLED:
            raise ValueError(f"finish_request needs a finished status other than prefilled, got {status}")
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._remove(request, status)
        return True

    def abort_request(self, request_id: str) -> bool:
        """Abort in any state (incl. a held prefilled request); idempotent, False if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._remove(request, RequestStatus.FINISHED_ABORTED)
        return True

    def release_request(self, request_id: str) -> bool:
        """Prefill role: free a held request's blocks (KV pulled or TTL expired); idempotent."""
        request = self.held.get(request_id)
        if request is None:
            return False
        self._remove(request, request.status)
        return True

    def _remove(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of whichever queue holds it, free its blocks and forget it."""
        request_id, old = request.request_id, request.status
        if old is _RUNNING:
            self.running.remove(request)
        elif old is RequestStatus.WAITING or old is RequestStatus.PREEMPTED:
            self.waiting.remove(request)
        elif old is RequestStatus.WAITING_FOR_BLOCKS:
            self.waiting_for_blocks.remove(request)
        elif old is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_remote_kv[request_id]
        elif old is RequestStatus.FINISHED_PREFILLED:
            del self.held[request_id]
        self._release_lora(request)
        self.kv_manager.free(request)
        del self.requests[request_id]
        if not old.is_finished:      # a held request already reported its end
            request.status = status
            request.finished_time = self.clock()
            self._finished_ids.append(request_id)

    def finished_in_update(self, request: Request, now: float) -> None:
        """`update` found a token-level stop (`_check_stop` set the status): free and forget it."""
        request.finished_time = now
        self._release_lora(request)
        self.kv_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def _release_lora(self, request: Request) -> None:
        """The request left the batch: its adapter's slot is free for others once unused."""
        if request.lora is not None:
            self.lora_slots.release(request.request_id)

    # ------------------------------------------------------------------ decode role
    def _reserve_remote(self) -> list[str]:
        """Reserve prompts (with a window, their last window) for queued remote requests, FIFO,
        keeping a watermark of free blocks for running decodes (none needed when nothing runs, so
        a big prompt cannot starve)."""
        kv, queue = self.kv_manager, self.waiting_for_blocks
        reserved = []
        now = self.clock()
        while queue and len(self.running) + len(self.waiting_for_remote_kv) < self.config.max_num_seqs:
            request = queue[0]
            busy = self.running or self.waiting_for_remote_kv
            spare = kv.num_free_blocks - kv.num_blocks_to_reserve(request.num_prompt_tokens)
            if spare < (self._watermark_blocks if busy else 0):
                break
            if request.lora is not None and not self.lora_slots.can_acquire(request):
                break          # every slot serves other adapters' requests: wait for one
            reserved_ok = kv.reserve(request, request.num_prompt_tokens)
            assert reserved_ok
            if request.lora is not None:
                self.lora_slots.acquire(request)
            queue.popleft()
            request.status = RequestStatus.WAITING_FOR_REMOTE_KV
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.waiting_for_remote_kv[request.request_id] = request
            reserved.append(request.request_id)
        return reserved

    def remote_kv_landed(self, request_id: str, first_token_id: int) -> bool:
        """The prompt's KV is in the reserved blocks and the prefill pod sampled `first_token_id`.

        The request joins the running decodes, or finishes right here on a stop (returns True).
        An unknown id (aborted while pulling) also returns True: there is nothing left to run.
        """
        request = self.requests.get(request_id)
        if request is None:
            return True
        if request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id!r} is {request.status.value}, not waiting for remote KV")
        del self.waiting_for_remote_kv[request_id]
        now = self.clock()
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv_manager.cache_blocks(request, request.num_computed_tokens)
        request.append_output_token(first_token_id)
        request.first_token_time = now
        if self._check_stop(request, first_token_id):
            request.finished_time = now
            self._release_lora(request)
            self.kv_manager.free(request)
            del self.requests[request_id]
            self._finished_ids.append(request_id)
            return True
        request.status = _RUNNING
        self.running.append(request)
        return False

    def remote_kv_failed(self, request_id: str) -> bool:
        """The pull failed (prefill pod lost): prefill the prompt here instead, ahead of newer
        waiting requests. The reserved blocks are freed (their partial KV is never cached); the
        local prefill allocates afresh after a prefix lookup. False when there is nothing to
        fall back (unknown id, or already past the pull)."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status is RequestStatus.WAITING_FOR_BLOCKS:
            self.waiting_for_blocks.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_remote_kv[request_id]
            self._release_lora(request)
            self.kv_manager.free(request)
        else:
            return False
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.push_front(request)
        return True

    # ------------------------------------------------------------------ queries and stats
    def get_request(self, request_id: str) -> Request | None:
        """A request still tracked here (unfinished, or prefilled and held), else None."""
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.waiting_for_blocks or self.waiting_for_remote_kv)

    @property
    def num_waiting(self) -> int:
        """Requests not in the batch yet: waiting, preempted, and (decode role) waiting for blocks or KV."""
        return len(self.waiting) + len(self.waiting_for_blocks) + len(self.waiting_for_remote_kv)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_held_kv(self) -> int:
        """Prefill role: finished requests whose blocks wait for a pull."""
        return len(self.held)

    @property
    def prefill_queue_tokens(self) -> int:
        """Tokens still to prefill here: waiting requests in full plus the rest of partial prefills.
        O(queue length): for metrics, not for every step."""
        queued = sum(r.num_tokens for r in self.waiting.unordered())
        remaining = (r.num_tokens - r.num_computed_tokens for r in self.running)
        partial = sum(n for n in remaining if n > 1)      # 1 left = a decode, not a prefill
        return queued + partial

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_manager.usage

    @property
    def prefix_cache_hit_ratio(self) -> float:
        return self.kv_manager.hit_ratio

    @property
    def num_free_blocks(self) -> int:
        return self.kv_manager.num_free_blocks

    def check_invariants(self) -> None:
        """For tests: the pool is consistent, each tracked request sits in exactly the container its
        status names, and every block's refcount equals the number of block tables holding it."""
        pool = self.kv_manager.block_pool
        pool.check_invariants()
        containers = {
            RequestStatus.RUNNING: [r.request_id for r in self.running],
            RequestStatus.WAITING: [r.request_id for r in self.waiting
                                    if r.status is RequestStatus.WAITING],
            RequestStatus.PREEMPTED: [r.request_id for r in self.waiting
                                      if r.status is RequestStatus.PREEMPTED],
            RequestStatus.WAITING_FOR_BLOCKS: [r.request_id for r in self.waiting_for_blocks],
            RequestStatus.WAITING_FOR_REMOTE_KV: list(self.waiting_for_remote_kv),
            RequestStatus.FINISHED_PREFILLED: list(self.held),
        }
        listed = [rid for ids in containers.values() for rid in ids]
        assert len(listed) == len(set(listed)) == len(self.requests), "a request is in two queues or none"
        num_queued = len(containers[RequestStatus.WAITING]) + len(containers[RequestStatus.PREEMPTED])
        assert len(self.waiting) == num_queued, "a waiting-queue entry has a non-waiting status"
        queued = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.WAITING_FOR_BLOCKS)
        refs = [0] * pool.num_blocks
        for status, ids in containers.items():
            for request_id in ids:
                request = self.requests[request_id]
                assert request.status is status, f"{request_id} is {request.status} but queued as {status}"
                if status in queued:
                    assert not request.block_ids and request.num_computed_tokens == 0, (
                        f"{request_id} holds blocks or computed tokens while queued")
                else:
                    assert len(request.block_ids) * self.block_size >= request.num_computed_tokens
                for block_id in request.block_ids:
                    refs[block_id] += 1
                if self.kv_manager.groups is not None:   # KV groups 1.. (engine.kv_groups)
                    pages = self.kv_manager.groups.pages(request_id)
                    assert not pages or len(pages) == len(request.block_ids) * (self.kv_manager.num_groups - 1)
                    for block_id in pages:
                        refs[block_id] += 1
        # The null block stands in a table only for blocks freed behind a sliding window.
        assert refs[0] == 0 or self.kv_manager.sliding_window is not None or self.kv_manager.groups is not None, (
            "a table holds the null block")
        refs[0] = 0
        assert refs == pool.ref_cnt, "block refcounts differ from the block tables holding them"
        assert len(self.running) + len(self.waiting_for_remote_kv) <= self.config.max_num_seqs
