"""The unified scheduler: one token budget per step shared by decodes and prefill chunks.

There are no prefill/decode phases (vLLM V1, Sarathi-Serve): a request has `num_tokens` and
`num_computed_tokens`, and each step schedules `num_tokens - num_computed_tokens` of it, capped by
the budget. Running requests go first — decodes (one token each, so they never stall behind a long
prompt), then partial prefills continuing their chunk — then waiting requests are admitted in policy
order into what is left, after a prefix-cache lookup. When a running request cannot get a block,
the lowest-priority / newest running request is preempted by recompute.

The engine step reads `out = scheduler.schedule(); sampled = runner.run(out);
scheduler.update(out, sampled)`. `schedule()` changes only block tables and queues; token counts
advance in `update()`, once the runner has computed them.

The containers and every event that is not a step (intake, endings, the disaggregation roles'
edges, metrics queries) live in `engine.scheduling.state.SchedulerState`, which `Scheduler` extends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.decode_columns import (COLUMNS_MIN_BATCH, reads_host_tokens, resolve_columns,
                                   schedule_columns, update_columns)
from engine.request import Request, RequestStatus
from engine.scheduling.request_queue import priority_key
from engine.scheduling.output import (PLACEHOLDER_TOKEN_ID, DecodeSeqs, ScheduledSeq, SchedulerOutput,
                                     new_scheduled_seq)
from engine.scheduling.state import ROLES, SchedulerState

__all__ = ["ROLES", "ScheduledSeq", "Scheduler", "SchedulerOutput"]

_RUNNING = RequestStatus.RUNNING


class Scheduler(SchedulerState):
    """Continuous-batching scheduler for one engine (see the module docstring); constructed as
    `SchedulerState`: `Scheduler(scheduler_config, kv, role, eos_token_ids, reserve_watermark)`.
    `decode_columns = True` (the engine, under async scheduling): steady decode steps are planned
    as columns (`engine.decode_columns`)."""

    decode_columns = False

    # ------------------------------------------------------------------ schedule
    def schedule(self, drafts: Mapping[str, Sequence[int]] | None = None) -> SchedulerOutput:
        """Pick this step's batch under the token budget; allocates blocks, computes nothing.

        `drafts` (speculative decoding, `engine.spec_decode`): draft tokens per running decode; each
        rides as extra query tokens after the request's last token (a `1 + k`-token chunk whose
        seq samples `1 + k` rows), where the budget and free blocks allow it after every decode
        has its own token: drafts never preempt, and shrink rather than take a block the pool
        needs for the batch's next step.

        Design: decodes first, then partial prefills, then admissions — so a long prompt only ever
        takes the budget that running requests left. Preemption frees a victim's blocks at once;
        if the victim was already scheduled this step it is taken out of the batch (nothing was
        computed for it yet). No admissions in a step that preempted: the pool is demonstrably
        short. The decode pass is the hot path (one visit to every running request each step):
        when the budget and the free blocks cover one token and one block per running request,
        nothing can preempt, and `_schedule_decodes_fast` skips every check that guards against it.
        With `decode_columns` such a step that admits nothing is planned as columns instead
        (`engine.decode_columns`: no pass over the batch).
        """
        max_tokens = self.config.max_num_batched_tokens
        reserved = self._reserve_remote() if self.waiting_for_blocks else ()
        if self.decode_columns and drafts is None and len(self.running) >= COLUMNS_MIN_BATCH \
                and self.lora_slots is None and self._decodes_cannot_run_short(max_tokens) and not self._can_admit():
            out = schedule_columns(self, tuple(reserved), tuple(self._finished_ids))
            if out is not None:
                self._finished_ids = []
                return out
        if self._columns is not None:
            self._columns.ready = False     # this step is planned without it (its rows stay)
        seqs: list[ScheduledSeq] = []           # batch order
        scheduled: list[Request] = []           # seqs[i] belongs to scheduled[i]
        preempted: list[str] = []
        partial: list[Request] = []             # running prefills, continued after the decodes
        if drafts is None and self._decodes_cannot_run_short(max_tokens):
            budget = max_tokens - self._schedule_decodes_fast(seqs, scheduled, partial)
        else:
            budget = self._schedule_decodes(max_tokens, seqs, scheduled, partial, preempted)
        if drafts:
            budget = self._add_drafts(drafts, budget, seqs, scheduled)
        for request in partial:
            if not budget:
                break
            if request.status is not _RUNNING:   # preempted earlier in this step
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.kv_manager.allocate_slots(request, num_new) or self._preempt_until_fits(
                    request, num_new, preempted):
                seqs.append(self._seq(request, num_new))
                scheduled.append(request)
                budget -= num_new
        if preempted:
            # Victims that had been scheduled leave the batch and give their tokens back.
            victims = set(preempted)
            kept = [i for i, seq in enumerate(seqs) if seq[0] not in victims]
            seqs, scheduled = [seqs[i] for i in kept], [scheduled[i] for i in kept]
            budget = max_tokens - sum(len(seq[1]) for seq in seqs)
        else:
            budget = self._admit_waiting(budget, seqs, scheduled)

        finished, self._finished_ids = self._finished_ids, []
        out = SchedulerOutput(tuple(seqs), max_tokens - budget, tuple(preempted), tuple(reserved), tuple(finished))
        self._pending_output, self._pending_requests = out, scheduled
        return out

    def _can_admit(self) -> bool:
        """A waiting request may join the batch this step (`_admit_waiting`'s loop condition)."""
        return bool(self.waiting) and len(self.running) + len(self.waiting_for_remote_kv) < self.config.max_num_seqs

    def _decodes_cannot_run_short(self, budget: int) -> bool:
        """Every running request can have a token and a new block: a decode needs at most one of
        each, and the partial prefills that might need more are scheduled after the decodes."""
        num_running, kv = len(self.running), self.kv_manager
        return num_running <= budget and num_running * kv.num_groups <= kv.num_free_blocks

    def _schedule_decodes_fast(self, seqs: list[ScheduledSeq], scheduled: list[Request],
                               partial: list[Request]) -> int:
        """Schedule every running decode when `_decodes_cannot_run_short`: no status checks, no copy
        of `running`, no budget test, no preemption, one comprehension. Returns the number of
        tokens scheduled."""
        block_size, grow, new_seq, seq_type = self.block_size, self._grow_by_one_block, new_scheduled_seq, ScheduledSeq
        running, tables = self.running, self.kv_manager.block_tables
        # The tables are the manager's tuples (every running request holds blocks, so has one):
        # copying a table would touch every block-id int (a refcount write each), which costs more
        # than the rest of the request's work.
        seqs += [
            new_seq(seq_type, (request_id, (tokens[start],), start,
                               table if start < len(table) * block_size else grow(request), True))
            for request in running
            for start in [request.num_computed_tokens]      # (3.9+ compiles these to assignments)
            for tokens in [request.token_ids]
            if len(tokens) - start < 2                      # a decode; prefills continue below
            for request_id in [request.request_id]
            for table in [tables[request_id]]
        ]
        if len(seqs) == len(running):
            scheduled += running
        else:
            partial += [r for r in running if len(r.token_ids) - r.num_computed_tokens > 1]
            prefilling = set(partial)
            scheduled += [r for r in running if r not in prefilling]
        return len(seqs)

    def _grow_by_one_block(self, request: Request) -> tuple[int, ...]:
        """The fast decode path's allocation (it cannot fail there): one more block."""
        self.kv_manager.allocate_slots(request, 1)
        return self.kv_manager.block_table(request)

    def _schedule_decodes(self, budget: int, seqs: list[ScheduledSeq], scheduled: list[Request],
                          partial: list[Request], preempted: list[str]) -> int:
        """Schedule running decodes in order while budget lasts, preempting when a block is short.
        Returns the budget left."""
        kv, block_size = self.kv_manager, self.block_size
        for request in tuple(self.running):     # a copy: preemption edits self.running
            if not budget:
                break
            if request.status is not _RUNNING:   # preempted earlier in this step
                continue
            tokens, start, block_ids = request.token_ids, request.num_computed_tokens, request.block_ids
            if len(tokens) - start > 1:
                partial.append(request)
                continue
            if start >= len(block_ids) * block_size and not (
                    kv.allocate_slots(request, 1) or self._preempt_until_fits(request, 1, preempted)):
                continue
            seqs.append(new_scheduled_seq(
                ScheduledSeq, (request.request_id, (tokens[start],), start, kv.block_table(request), True)))
            scheduled.append(request)
            budget -= 1
        return budget

    def _add_drafts(self, drafts: Mapping[str, Sequence[int]], budget: int, seqs: list[ScheduledSeq],
                    scheduled: list[Request]) -> int:
        """Extend scheduled decodes with their drafts (`schedule`); returns the budget left. A
        request whose drafts need a new block gets one only while a block per running request
        stays free (the next step's decodes may each need one); else its drafts shrink to what its
        blocks already hold."""
        kv, block_size, headroom = self.kv_manager, self.block_size, len(self.running)
        for i, request in enumerate(scheduled):
            if budget <= 0:
                break
            proposed = drafts.get(request.request_id)
            if not proposed or request.status is not _RUNNING:   # (a victim of a later decode's growth)
                continue
            token, start = seqs[i][1][0], request.num_computed_tokens
            num = min(len(proposed), budget)
            num_new_blocks = (kv.num_blocks_for(start + 1 + num) - len(request.block_ids)) * kv.num_groups
            if num_new_blocks > 0 and kv.num_free_blocks - num_new_blocks < headroom:
                num = len(request.block_ids) * block_size - start - 1
            if num <= 0 or not kv.allocate_slots(request, 1 + num):
                continue
            seqs[i] = ScheduledSeq(request.request_id, (token, *proposed[:num]), start, kv.block_table(request),
                                   1 + num)
            budget -= num
        return budget

    def _seq(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        end = start + num_new
        tokens = request.token_ids
        return ScheduledSeq(request.request_id, tuple(tokens[start:end]), start,
                            self.kv_manager.block_table(request), end == len(tokens))

    def _admit_waiting(self, budget: int, seqs: list[ScheduledSeq], scheduled: list[Request]) -> int:
        """Admit waiting requests in policy order (chunked into `budget`); returns the budget left."""
        kv, waiting, config = self.kv_manager, self.waiting, self.config
        now = self.clock()
        while budget and self._can_admit():
            request = waiting.peek()
            if request.lora is not None and not self.lora_slots.can_acquire(request):
                break          # every slot serves other adapters' running requests: wait for one
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not config.enable_chunked_prefill:
                    break
                num_new = budget
            if not kv.allocate_slots(request, num_new, hits):
                break          # head-of-line: keep policy order rather than skip to a smaller one
            waiting.pop()
            if request.lora is not None:
                self.lora_slots.acquire(request)
            request.status = _RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            seqs.append(self._seq(request, num_new))
            scheduled.append(request)
            budget -= num_new
        return budget

    def _preempt_until_fits(self, request: Request, num_new: int, preempted: list[str]) -> bool:
        """Preempt victims until `request` gets its blocks; False when it was the victim itself.
        `schedule` drops the victims' seqs from the batch afterwards."""
        while True:
            if self.config.policy == "priority":   # ties: the newest admission goes first
                victim = max(reversed(self.running), key=priority_key)
            else:
                victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
            if self.kv_manager.allocate_slots(request, num_new):
                return True

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: free the blocks; the request re-enters the front of the queue."""
        self.running.remove(request)
        self._release_lora(request)
        self.kv_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)

    def _update_verified(self, request: Request, start: int, emitted: list[int], now: float) -> bool:
        """A decode verified with drafts: `emitted` = the accepted drafts and the token after them.
        Only the accepted tokens' KV counts (`num_computed_tokens` = start + len(emitted): the
        last token of the step's input plus the accepted drafts); the rejected drafts' slots are
        beyond it, so the next steps overwrite them, in blocks the request keeps. Stops apply
        token by token, and a stop drops the tokens after it. Returns whether it finished."""
        outputs, tokens, params = request.output_token_ids, request.token_ids, request.sampling_params
        eos_ids, kv = self.eos_token_ids, self.kv_manager
        finished = False
        num = 0
        for token_id in emitted:
            outputs.append(token_id)
            tokens.append(token_id)
            num += 1
            if (len(outputs) >= params.max_tokens or token_id in eos_ids or token_id in params.stop_token_ids) \
                    and self._check_stop(request, token_id):
                finished = True
                break
        if request.first_token_time is None:
            request.first_token_time = now
        request.num_computed_tokens = start + num
        if start // self.block_size != (start + num) // self.block_size:   # a block became full
            kv.cache_blocks(request, start + num)
        if finished:
            request.finished_time = now
            kv.free(request)
            del self.requests[request.request_id]
            self._finished_ids.append(request.request_id)
        return finished

    def resolve_placeholders(self, requests: list[Request], token_ids: list[int]) -> list[Request]:
        if self._columns is not None:
            self._columns.ready = False   # its plan assumed placeholders (a step that resolves first)
        if self._resolving is not None:
            resolved = resolve_columns(self, requests, token_ids)
            if resolved is not None:
                return resolved
        return super().resolve_placeholders(requests, token_ids)

    resolve_placeholders.__doc__ = SchedulerState.resolve_placeholders.__doc__

    def reads_host_tokens(self, requests: list[Request]) -> bool:
        """Some request's next step needs its newest token's value on the host (penalties, a
        grammar): an async step resolves the one in flight first."""
        return reads_host_tokens(self._columns, requests)

    @property
    def scheduled_requests(self) -> list[Request]:
        """The requests of the latest `schedule()`'s seqs, in batch order (until `update`)."""
        return self._pending_requests

    # ------------------------------------------------------------------ update
    def update(self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int] | None) -> list[Request]:
        """Apply a computed step: advance token counts, cache full blocks, append sampled tokens,
        apply token-level stops and free finished requests.

        `sampled_token_ids` maps the id of every seq with `sample=True` to its new token, and of a
        seq with drafts (`sample = 1 + k`) to its emitted tokens (`_update_verified`). None
        (async scheduling, colocated and decode roles): the tokens are still on the device, so each
        sampling request gets `PLACEHOLDER_TOKEN_ID`, only length stops apply, and the engine
        calls `resolve_placeholders` once the tokens are known (the next step is scheduled before
        that, with the placeholder as its input). Returns
        the requests that got a token this step (finished or not); `last_progressed` lists every
        request whose `num_computed_tokens` advanced. Seqs of requests aborted or finished between
        `schedule` and `update` are skipped (their status is no longer RUNNING). The requests come
        from the list `schedule` kept beside the seqs, not from a lookup by id.
        """
        if output is not self._pending_output:
            raise ValueError("update() takes the output of the latest schedule(), once")
        scheduled, self._pending_output, self._pending_requests = self._pending_requests, None, []
        now = self.clock()
        if sampled_token_ids is None and isinstance(output.scheduled, DecodeSeqs):
            done = update_columns(self, output.scheduled, now)
            if done is not None:
                return done
        self._resolving = None
        kv, block_size = self.kv_manager, self.block_size
        prefill_role = self.role == "prefill"
        if prefill_role and sampled_token_ids is None:
            raise ValueError("the prefill role needs its sampled tokens in update (no async scheduling)")
        eos_ids = self.eos_token_ids
        # The usual step skips nobody and samples everybody: its lists are `scheduled` itself, so
        # the loop only notes the exceptions.
        skipped: list[Request] = []
        unsampled: list[Request] = []
        any_finished = False
        running_status = _RUNNING
        for (request_id, new_tokens, start, _, sample), request in zip(output.scheduled, scheduled):
            if request.status is not running_status:
                skipped.append(request)
                continue
            if sample > 1:   # drafts verified: the accepted ones and the token after them
                any_finished |= self._update_verified(request, start, sampled_token_ids[request_id], now)
                continue
            num_new = len(new_tokens)
            request.num_computed_tokens = start + num_new
            if start % block_size + num_new >= block_size:   # a block became full
                kv.cache_blocks(request, start + num_new)
            if not sample:
                unsampled.append(request)
                continue
            if sampled_token_ids is None:
                token_id = PLACEHOLDER_TOKEN_ID
            else:
                try:
                    token_id = sampled_token_ids[request_id]
                except KeyError:
                    raise KeyError(f"no sampled token for request {request_id!r} (sample=True)") from None
            outputs, tokens = request.output_token_ids, request.token_ids
            outputs.append(token_id)
            tokens.append(token_id)
            if request.first_token_time is None:
                request.first_token_time = now
            if prefill_role:
                # The first token ends the prefill; the blocks stay referenced for the KV pull.
                request.status = RequestStatus.FINISHED_PREFILLED
                request.finished_time = now
                self._release_lora(request)
                self.held[request_id] = request
                self._finished_ids.append(request_id)
                any_finished = True
                continue
            params = request.sampling_params
            # Cheap screen first (the usual answer is "no stop"); _check_stop decides exactly.
            # No max_model_len test here: admission guarantees prompt + max_tokens <= max_model_len.
            if (len(outputs) < params.max_tokens
                    and token_id not in eos_ids and token_id not in params.stop_token_ids):
                continue
            if self._check_stop(request, token_id):
                self.finished_in_update(request, now)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        progressed = scheduled
        if skipped:
            skipped_set = set(skipped)
            progressed = [r for r in scheduled if r not in skipped_set]
        if unsampled:
            unsampled_set = set(unsampled)
            sampled = [r for r in progressed if r not in unsampled_set]
        else:
            sampled = list(progressed)
        self.last_progressed = progressed
        return sampled
