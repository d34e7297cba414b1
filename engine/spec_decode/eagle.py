"""Drafts from an EAGLE-1 head over the target's hidden states, with the head's own paged KV.

The head (`engine.spec_decode.eagle_head`) is a one-layer model whose position p reads the
target's final hidden state h_p (after the final norm, what HF's `last_hidden_state` and vLLM's
EAGLE hand over) and the embedding of token p + 1, and predicts token p + 2. So it is a
`DraftModelProposer` shifted by one position: it shares the target's block tables (block b holds
the head's KV of positions in b), catches up lazily on the positions since its last proposal (up
to n - 1, with the newest token t_n), and runs `k - 1` passes over its own drafts, each reading the
head's output of the pass before in place of a target hidden state. Only the catch-up positions'
KV counts afterwards (`_kept`): the passes' positions are recomputed from the target's hidden
states once verified, as EAGLE does.

The hidden states come from the target's runner (`ModelRunner(hidden_sink=...)`): every target
forward, plain or speculative, hands its `[T, hidden]` states to `hidden_sink`, which puts them
into a device ring (`engine.spec_decode.hidden_states`) and notes each request's positions on the
host (both lazily: copied and filed when the head next proposes, so plain steps stay cheap). A step with no EAGLE configured passes None and does nothing more. Positions this engine
did not compute (a prompt prefilled on a prefill pod, prefix-cache hits) read zeros: the head
proposes from the tokens alone there, so a decode pod accepts fewer drafts early in a request than
a colocated engine; the output is the same (verification decides every token).
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch

from engine.model_config import ModelConfig
from engine.spec_decode.draft_model import DraftModelProposer, _DraftState
from engine.spec_decode.eagle_head import load_eagle_head
from engine.spec_decode.hidden_states import Chunks, HiddenStates


class _EagleState(_DraftState):
    __slots__ = ("chunks",)

    def __init__(self, preemptions: int) -> None:
        super().__init__(preemptions)
        self.chunks = Chunks()


class EagleProposer(DraftModelProposer):
    """Greedy drafts from an EAGLE-1 head. `attach` the target's model and scheduler before the
    first forward that should feed it."""

    shift = 1
    _new_state = _EagleState

    def _load(self, model: str, target_dir: Path, target_cfg: ModelConfig, max_position: int):
        head = load_eagle_head(self.model_dir, target_cfg, self.dtype, self.device, max_position)
        # Two full steps' rows at least (a prompt longer than the ring reads zeros for its start);
        # allocated before the KV cache is sized. 2 * 8192 rows of an 8B model (4096 wide, bf16): 128 MiB.
        rows = max(2 * self.max_num_batched_tokens, 2048)
        self.hidden = HiddenStates(rows, target_cfg.hidden_size, self.dtype, self.device)
        self.target = self.scheduler = None
        self._carry: dict[str, torch.Tensor] = {}     # request id -> the head's output for its next pass
        self._unfiled: deque = deque()   # (first ring row, rows, [(position, count, request, preemptions)]) per step
        return head

    def attach(self, target, scheduler) -> None:
        """`target`: the target's `CausalLM` (its embedding and lm_head serve the head)."""
        self.target, self.scheduler = target, scheduler

    def hidden_sink(self, scheduled, hidden: torch.Tensor, owned: bool = False) -> None:
        """After a target forward: `hidden` [T, hidden] in the order of `scheduled`'s tokens
        (`owned`: nothing writes it later, `HiddenStates.write`). Which rows hold which request's
        positions is noted as it comes and filed into the requests' `Chunks` when the head next
        proposes (`_file`): a step that does not speculate pays one pass over its seqs."""
        if self.scheduler is None:          # a warm-up forward before the engine is assembled
            return
        row = self.hidden.write(hidden, owned)
        self._unfiled.append((row, hidden.shape[0], [(seq[2], len(seq[1]), request, request.num_preemptions)
                                                     for seq, request in zip(scheduled, self.scheduler.scheduled_requests)]))
        oldest, unfiled = self.hidden.oldest, self._unfiled
        while unfiled[0][0] + unfiled[0][1] <= oldest:   # every row of it pushed out of the ring
            unfiled.popleft()

    def _file(self) -> None:
        """File the noted steps' rows into their requests' `Chunks`, in order, as each would have
        been at its step: a request preempted since has a new state (its old rows do not count),
        and what a filing drops (rows out of the ring, positions the head has read) is what the
        ring or the head would not give anyway (`Chunks.record`)."""
        oldest, state_of, unfiled = self.hidden.oldest, self._state, self._unfiled
        while unfiled:
            row, _, seqs = unfiled.popleft()
            for position, count, request, preemptions in seqs:
                if request.num_preemptions == preemptions:
                    state = state_of(request)
                    state.chunks.record(position, row, count, oldest, state.computed)
                row += count

    def propose(self, pairs: list) -> dict[str, tuple[int, ...]]:
        if self._unfiled:
            self._file()
        drafts = super().propose(pairs)
        self._carry = {}
        return drafts

    def _kept(self, seq) -> int:
        return seq[2]          # positions < n: read target hidden states; the passes' did not

    def _run(self, step: list, catch_up: dict | None) -> torch.Tensor:
        t = self.runner.prepare(step)
        if catch_up is not None:
            state_of = self._state
            hidden = self.hidden.gather([(state_of(catch_up[s[0]]).chunks, s[2], len(s[1])) for s in step])
        else:
            hidden = torch.stack([self._carry[s[0]] for s in step])
        out = self.model(self.target.embed_tokens(t.input_ids), hidden, t.positions, self.kv_cache, t.meta)
        if t.layout.num_sampled != out.shape[0]:
            out = out[t.logits_indices]
        self._carry.update(zip((s[0] for s in step if s[4]), out))
        return self.target.compute_logits(out)
