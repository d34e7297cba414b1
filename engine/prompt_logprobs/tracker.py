"""Which requests still need prompt logprobs, and how each step computes theirs.

Where the scores come from: the logits at prompt position `p` score token `p + 1`, so a chunk that
computes positions `[start, end)` scores tokens `start + 1 .. end` of its own rows, with nothing
carried between steps; chunk boundaries change nothing. Position `n - 1` (the prompt's last) is
the row that samples the first output token, not a score. Each step, `plan` lists the flat token
rows of the batch whose logits are needed (`StepRows.rows`), the runner computes their logits
after the sampled rows' and hands them over a bounded slice at a time (`StepRows.consume`:
log_softmax, the target's logprob and rank, the top-k, all on the device), and `StepRows.finish`
reads the step's scores back once and appends them to each request's `PromptLogprobs`.

Prefix caching: the cached part of a prompt has KV but no hidden states, and its scores need the
hidden states, i.e. the same forward pass the prefill would do. So a request that asks skips the
prefix-cache *lookup* (`Request.skip_reading_prefix_cache`, vLLM V1 does the same) until its
scores are complete: its chunks run the model from token 0 like an uncached prompt, and its full
blocks are still offered to the cache. Reusing the cached KV and running the cached positions
anyway would cost the same forward pass and save only the KV writes, at the price of a second
kind of step in the runner. Recompute after a preemption scores nothing twice: positions already
scored are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from engine.prompt_logprobs.values import PromptLogprobs
from engine.request import Request


@dataclass
class _Pending:
    request: Request
    values: PromptLogprobs

    @property
    def num_targets(self) -> int:   # prompt tokens that get a score
        return self.request.num_prompt_tokens - 1


@dataclass
class StepRows:
    """One step's extra logits rows: `rows` (flat token indices of the step, after its sampled
    rows in `logits_indices`), the prompt token each scores, and whose scores they are."""

    rows: np.ndarray                              # [R] int64
    targets: np.ndarray                           # [R] int64: the prompt token row r scores
    owners: list[tuple[_Pending | None, int]]     # (request, number of rows), in row order; None: padding
    max_top: int
    _targets_device: torch.Tensor | None = None
    _parts: list[tuple[torch.Tensor, ...]] = field(default_factory=list)

    def consume(self, first_row: int, logits: torch.Tensor) -> None:
        """Runner: logits `[n, vocab]` of rows `first_row .. first_row + n` (model dtype)."""
        if self._targets_device is None:
            self._targets_device = torch.from_numpy(self.targets).to(logits.device, non_blocking=True)
        logprobs = logits.float().log_softmax(dim=-1)                                       # [n, vocab]
        target_lp = logprobs.gather(1, self._targets_device[first_row:first_row + logits.shape[0], None])  # [n, 1]
        ranks = (logprobs > target_lp).sum(dim=1) + 1                                      # [n]
        part = (target_lp[:, 0], ranks)
        if self.max_top:
            part += tuple(logprobs.topk(min(self.max_top, logprobs.shape[1]), dim=-1))   # [n, k] values, ids
        self._parts.append(part)

    def finish(self) -> list[_Pending]:
        """Read the step's scores back (one transfer per kind) and append them to their requests;
        returns the requests whose scores are now complete."""
        if not self._parts:
            return []
        columns = [torch.cat(column).tolist() for column in zip(*self._parts)]
        self._parts = []
        token_lp, ranks = columns[0], columns[1]
        top_values, top_ids = (columns[2], columns[3]) if self.max_top else ((), ())
        complete, row = [], 0
        for pending, count in self.owners:
            if pending is None:
                continue
            values, k = pending.values, pending.values.num_top
            values.token_logprobs += token_lp[row:row + count]
            values.token_ranks += ranks[row:row + count]
            if k:
                for r in range(row, row + count):
                    values.top_token_ids += top_ids[r][:k]
                    values.top_logprobs += top_values[r][:k]
            row += count
            if values.num_scored == pending.num_targets:
                complete.append(pending)
        return complete


class PromptLogprobsTracker:
    """The engine's prompt-logprob requests: pending (scores to compute) and done (to emit)."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self._done: dict[str, PromptLogprobs] = {}

    @property
    def pending(self) -> bool:
        """Some request still needs scores: the engine plans extra rows only then."""
        return bool(self._pending)

    @property
    def has_done(self) -> bool:
        return bool(self._done)

    def add(self, request: Request) -> None:
        """Track `request` if it asks for prompt logprobs and this engine runs its prompt."""
        num_top = request.sampling_params.prompt_logprobs
        if num_top is None:
            return
        values = PromptLogprobs(num_top)
        if request.num_prompt_tokens < 2:      # nothing to score: done already
            self._done[request.request_id] = values
            return
        self._pending[request.request_id] = _Pending(request, values)
        request.skip_reading_prefix_cache = True

    def received(self, request_id: str, values: PromptLogprobs) -> None:
        """Scores computed elsewhere (the prefill pod): emitted with the request's first output."""
        self._done[request_id] = values

    def discard(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._done.pop(request_id, None)

    def take(self, request_id: str) -> PromptLogprobs | None:
        """A request's complete scores, once (its first output carries them)."""
        return self._done.pop(request_id, None)

    def plan(self, scheduled: Sequence) -> StepRows | None:
        """This step's extra rows (None when no scheduled chunk scores anything). Visits every
        scheduled seq, but only in steps where some request is pending."""
        pending = self._pending
        rows: list[np.ndarray] = []
        targets: list[Sequence[int]] = []
        owners: list[tuple[_Pending | None, int]] = []
        offset = num_sampled = 0
        for seq in scheduled:
            num_new = len(seq.token_ids)
            num_sampled += seq.sample
            entry = pending.get(seq.request_id)
            if entry is not None:
                start = seq.start_position
                first = entry.values.num_scored    # recompute after a preemption: not again
                assert first >= start, "prompt logprobs: a chunk started past the unscored positions"
                end = min(start + num_new, entry.num_targets)
                if first < end:
                    rows.append(np.arange(offset + first - start, offset + end - start, dtype=np.int64))
                    targets.append(entry.request.prompt_token_ids[first + 1:end + 1])
                    owners.append((entry, end - first))
            offset += num_new
        if not rows:
            return None
        if num_sampled + sum(n for _, n in owners) == offset:
            # Every token row would go through the head. The runner (on every tensor-parallel rank)
            # skips the gather by `logits_indices` when the head takes as many rows as the step has
            # tokens, which is the identity order only for decode steps: one repeated row keeps the
            # counts apart, so every rank gathers in the same order.
            rows.append(rows[-1][-1:])
            targets.append(targets[-1][-1:])
            owners.append((None, 1))
        flat_targets = np.fromiter((t for part in targets for t in part), np.int64, sum(n for _, n in owners))
        max_top = max(entry.values.num_top for entry, _ in owners if entry is not None)
        return StepRows(np.concatenate(rows), flat_targets, owners, max_top)

    def finish(self, step: StepRows) -> None:
        """After the step's forward pass: its scores to their requests; complete ones become done
        (and may use the prefix cache again, after a later preemption)."""
        for entry in step.finish():
            request_id = entry.request.request_id
            if self._pending.pop(request_id, None) is entry:
                entry.request.skip_reading_prefix_cache = False
                self._done[request_id] = entry.values
