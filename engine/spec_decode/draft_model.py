"""Drafts from a small model on the target's tokenizer, with its own paged KV.

The draft has its own weights, its own KV cache tensor and its own `ModelRunner` (eager, no
graphs, unsharded on rank 0 under tensor parallelism), and shares the target's *block tables*:
block `b` of a request holds the target's KV of its tokens in the target's cache and the draft's
KV of the same tokens in the draft's cache (SGLang's "indices are always shared with a target
model"). So the scheduler's decisions (allocation, prefix caching, preemption, freeing) serve both
caches, and the KV sizing gives each block room in both (`Engine` shrinks the block count).

The draft catches up lazily: each request remembers how many of its tokens have draft KV
(`computed`), and a proposal first runs the draft over the tokens since then, up to the
request's newest token (its whole prompt on the first proposal: how a decode pod that received
the target's KV from a prefill pod fills the draft's, from the prompt it already has, so P/D and
colocated propose the same drafts; unless the prefill pod shipped the draft's KV with the
target's, `received`: then only the first token). Then it runs `k - 1` one-token passes over its
own greedy drafts. Prefix-cache hits are caught up from position 0 too: a shared block's draft KV may never
have been written (the request that filled it may have ended without proposing), and rewriting a
shared block writes the same values (same tokens at the same positions).

After verification only the draft KV of accepted tokens counts (`settle`): positions from the
first rejected draft on hold KV of rejected tokens. Drafts are argmax tokens (point masses): see
`engine.spec_decode.rejection_sampler`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import weakref
from pathlib import Path

import torch

from engine.config import CacheConfig
from engine.kv_cache import allocate_kv_cache, bytes_per_block
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.presets import resolve_model_dir
from engine.sampling.random_sampling import row_argmax
from engine.spec_decode.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfigError

log = logging.getLogger(__name__)


class _DraftState:
    __slots__ = ("computed", "preemptions", "__weakref__")

    def __init__(self, preemptions: int) -> None:
        self.computed, self.preemptions = 0, preemptions


def _tokenizer_digest(model_dir: Path) -> str | None:
    path = model_dir / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def fit_cache(draft, sized: CacheConfig, requested: CacheConfig, target_cfg: ModelConfig,
              kv_dtype: torch.dtype) -> CacheConfig:
    """A draft model's (or an EAGLE head's) cache has a block for every target block: the memory
    sized for the target is split between the two (an explicit `--num-blocks` gives both that many)."""
    if requested.num_blocks is not None:
        return sized
    target = bytes_per_block(target_cfg, sized.block_size, kv_dtype)
    share = target / (target + draft.block_bytes(sized.block_size))
    num_blocks = max(2, int(sized.num_blocks * share))
    log.info("KV cache: %d of %d blocks, the rest of the memory for the draft model's KV", num_blocks,
             sized.num_blocks)
    return dataclasses.replace(sized, num_blocks=num_blocks)


class DraftModelProposer:
    """Greedy drafts from a draft model (see the module docstring). `allocate` once the engine
    has sized the KV cache, before the first `propose`."""

    # The proposer's position p holds token p + shift: 0 for a draft model, 1 for an EAGLE head
    # (which reads the target's hidden state at p with the token after it: `engine.spec_decode.eagle`).
    shift = 0

    def __init__(self, model: str, target_dir: Path, target_cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        try:
            self.model_dir = resolve_model_dir(model)
        except FileNotFoundError as e:
            raise SpeculativeConfigError(f"speculative model: {e}") from None
        self.dtype, self.device = dtype, device
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.model = self._load(model, target_dir, target_cfg, max_model_len + MAX_SPECULATIVE_TOKENS + 1)
        self.cfg: ModelConfig = self.model.cfg
        self.kv_cache: torch.Tensor | None = None
        self.runner: ModelRunner | None = None
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _load(self, model: str, target_dir: Path, target_cfg: ModelConfig, max_position: int):
        """The proposer's model, checked against the target's (same vocabulary and tokenizer)."""
        cfg = ModelConfig.from_dir(self.model_dir)
        if cfg.vocab_size != target_cfg.vocab_size:
            raise SpeculativeConfigError(
                f"the draft model {model!r} has a vocabulary of {cfg.vocab_size} tokens, the target "
                f"{target_cfg.vocab_size}: a draft must use the target's tokenizer")
        draft_tok, target_tok = _tokenizer_digest(self.model_dir), _tokenizer_digest(target_dir)
        if draft_tok is not None and target_tok is not None and draft_tok != target_tok:
            raise SpeculativeConfigError(f"the draft model {model!r} has another tokenizer.json than the target")
        return load_model(self.model_dir, cfg, self.dtype, self.device, max_position)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block in the draft's cache (its model dtype)."""
        return bytes_per_block(self.cfg, block_size, self.dtype)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.kv_cache = allocate_kv_cache(self.cfg, num_blocks, block_size, self.dtype, self.device)
        self.runner = ModelRunner(self.model, self.kv_cache, block_size, self.device,
                                  max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                  max_model_len=self.max_model_len, enforce_eager=True)

    def _state(self, request) -> _DraftState:
        state = self._states.get(request)
        if state is None or state.preemptions != request.num_preemptions:   # recomputed: its KV is gone
            state = self._states[request] = self._new_state(request.num_preemptions)
        return state

    _new_state = _DraftState

    def propose(self, pairs: list) -> dict[str, tuple[int, ...]]:
        """Drafts for `(request, seq)` pairs: `seq` is the request's scheduled verification, with
        `len(seq.token_ids) - 1` draft slots allocated (their tokens are placeholders)."""
        if not pairs:
            return {}
        drafts = {seq[0]: [token] for (_, seq), token in zip(pairs, self._first_drafts(pairs))}
        longest, shift = max(len(seq[1]) - 1 for _, seq in pairs), self.shift
        for j in range(1, longest):            # input draft j at position n - shift + j -> draft j + 1
            step = [(seq[0], (drafts[seq[0]][-1],), seq[2] - shift + j, seq[3], True)
                    for _, seq in pairs if len(seq[1]) - 1 > j]
            for (request_id, *_), token in zip(step, self._argmax(self._run(step, None))):
                drafts[request_id].append(token)
        for request, seq in pairs:
            self._state(request).computed = self._kept(seq)
        return {request_id: tuple(tokens) for request_id, tokens in drafts.items()}

    def _kept(self, seq) -> int:
        """The positions whose KV stays valid once the drafts are accepted: < n + k (the drafts' KV
        was computed from the very tokens it would have been)."""
        return seq[2] + len(seq[1]) - 1

    def _run(self, step: list, catch_up: dict | None) -> torch.Tensor:
        """Logits of `step`'s sampled rows; `catch_up` (request id -> request): a catch-up
        forward, None: one of the draft passes."""
        return self.runner.run(step)

    def _first_drafts(self, pairs: list) -> list[int]:
        """Catch every request up to its newest token (position n = seq.start_position; n - shift
        in the proposer's positions) and return each one's first draft; chunked under the step
        budget, so a long catch-up (a whole prompt) takes several forwards."""
        pending, shift = {}, self.shift
        by_id = {seq[0]: request for request, seq in pairs}
        for request, seq in pairs:
            start = min(self._state(request).computed, seq[2] - shift)
            pending[seq[0]] = [request, start, seq]
        first: dict[str, int] = {}
        while len(first) < len(pairs):
            budget, step = self.max_num_batched_tokens, []
            for request_id, entry in pending.items():
                request, start, seq = entry
                if request_id in first or budget <= 0:
                    continue
                stop = seq[2] - shift + 1
                end = min(stop, start + budget)
                step.append((request_id, tuple(request.token_ids[start + shift:end + shift]), start, seq[3],
                             end == stop))
                entry[1] = end
                budget -= end - start
            sampled = [s[0] for s in step if s[4]]
            logits = self._run(step, by_id)
            if sampled:
                first.update(zip(sampled, self._argmax(logits)))
        return [first[seq[0]] for _, seq in pairs]

    @staticmethod
    def _argmax(logits: torch.Tensor) -> list[int]:
        return row_argmax(logits.float()).tolist()

    def received(self, request) -> None:
        """The draft's KV of the request's prompt came with the target's (a prefill pod computed
        it, `engine.spec_decode.draft_prefill`): the first proposal catches up from there."""
        self._state(request).computed = request.num_prompt_tokens

    def settle(self, request) -> None:
        """After verification: draft KV past the accepted tokens holds rejected drafts."""
        state = self._states.get(request)
        if state is not None:
            state.computed = min(state.computed, request.num_computed_tokens)
