"""`SpecDecoder`: the engine's handle on speculative decoding (proposer + controller + verifier + counts).

A speculative step (`Engine._step_speculative`) reads
`drafts = spec.propose(scheduler)` -> `out = scheduler.schedule(drafts)` ->
`seqs = spec.fill(out.scheduled, requests)` -> `logits = runner.run(seqs)` ->
`verified = spec.verify(sampler, logits, seqs, requests)` -> `scheduler.update(out, verified.tokens)`
-> `spec.settle(...)`: every running decode's drafts go through ONE target forward as extra query
tokens (a decode with k drafts is a `1 + k`-token chunk through the paged kernels, sampling its
last `1 + k` rows), prefill chunks and admissions in the same step as usual.

Drafts need the host to know each request's newest token (n-gram looks it up, the draft model
continues from it), so a speculative step is synchronous: with async scheduling the engine first
resolves the step in flight (as it does for penalties), and speculates only where the measured
rates say that pays (`engine.spec_decode.adaptive`), so plain steps keep their overlap.

Requests with a grammar (`SamplingParams.structured`) are never given drafts (a draft would have
to be checked against the grammar's matcher, advanced and rolled back per draft: not built):
their rows are plain rows of the speculative step, masked and advanced as in a plain step.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.config import CacheConfig
from engine.model_config import ModelConfig
from engine.request import RequestStatus
from engine.sampling.sampler import Sampler
from engine.spec_decode.adaptive import SpecController
from engine.spec_decode.config import MODEL_METHODS, SpeculativeConfig
from engine.spec_decode.draft_model import DraftModelProposer, fit_cache
from engine.spec_decode.eagle import EagleProposer
from engine.spec_decode.stats import SpecDecodeStats
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.rejection_sampler import Verified, verify
from engine.spec_decode.shadow import ShadowDrafts

log = logging.getLogger(__name__)
_RUNNING = RequestStatus.RUNNING
_SLOT = 0     # a draft model's slot before its draft is known (replaced in `fill`)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 draft: DraftModelProposer | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft
        self.ngram = None if draft is not None else NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.controller = SpecController(config.num_speculative_tokens, config.disable_by_batch_size)
        self.stats = SpecDecodeStats()
        # n-gram drafts cost a lookup: where a bucket runs plain they are checked against what it
        # emits instead of verified (`engine.spec_decode.shadow`); a draft model's are too dear.
        self.shadow = None if self.ngram is None else ShadowDrafts(self.ngram, self.controller)
        self._shadowing = False      # this step's bucket runs plain by choice (its probes: no retries)

    @classmethod
    def create(cls, config: SpeculativeConfig | None, role: str, target_dir: Path, target_cfg: ModelConfig,
               dtype: torch.dtype, device: torch.device, max_model_len: int, max_num_seqs: int,
               max_num_batched_tokens: int) -> SpecDecoder | None:
        """None without a config, and for the prefill role (its requests end at their first
        token: nothing to speculate; the flag is accepted so pods share one command line)."""
        if config is None:
            return None
        if role == "prefill":
            log.info("speculative decoding (%s) is for decode steps: the prefill role ignores it", config.method)
            return None
        draft = None
        if config.method in MODEL_METHODS:
            proposer = EagleProposer if config.method == "eagle" else DraftModelProposer
            draft = proposer(config.model, target_dir, target_cfg, dtype, device, max_model_len, max_num_seqs,
                             max_num_batched_tokens)
        log.info("speculative decoding: %s, up to %d tokens per step", config.to_json(), config.num_speculative_tokens)
        return cls(config, max_model_len, draft)

    @property
    def hidden_sink(self):
        """For the target's `ModelRunner`: where its forwards' hidden states go (an EAGLE head's
        ring, `engine.spec_decode.eagle`); None for the other proposers (the runner keeps none)."""
        return self.draft.hidden_sink if isinstance(self.draft, EagleProposer) else None

    def attach(self, target_model, scheduler) -> None:
        """Once the engine is assembled: an EAGLE head reads the target's embedding, lm_head and
        the scheduler's batch order."""
        if isinstance(self.draft, EagleProposer):
            self.draft.attach(target_model, scheduler)

    # ------------------------------------------------------------------ KV (draft model, EAGLE head)
    def fit_cache(self, sized: CacheConfig, requested: CacheConfig, target_cfg: ModelConfig,
                  kv_dtype: torch.dtype) -> CacheConfig:
        """A draft model's (or an EAGLE head's) cache has a block for every target block: the memory
        sized for the target is split between the two (an explicit `--num-blocks` gives both that many)."""
        return sized if self.draft is None else fit_cache(self.draft, sized, requested, target_cfg, kv_dtype)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        if self.draft is not None:
            self.draft.allocate(num_blocks, block_size)

    # ------------------------------------------------------------------ the step
    def wants_step(self, scheduler) -> bool:
        running = scheduler.running
        mixed = bool(scheduler.waiting) or any(len(r.token_ids) - r.num_computed_tokens > 1 for r in running)
        controller, predict = self.controller, None
        self._shadowing = self.shadow is not None and controller.shadows(len(running))
        if self._shadowing and not mixed:
            def predict():
                return self.shadow.observe([r for r in running if r.status is _RUNNING], len(running))
        return controller.wants_step(len(running), mixed, predict)

    def propose(self, scheduler) -> dict[str, list[int]] | None:
        """Drafts of every running decode that gets some (n-gram: the tokens; draft model: slots
        that `fill` gives tokens once scheduled, so the draft writes only into allocated blocks).
        None: drafts were found, but the controller priced them as a loss (`SpecController.declines`):
        the step runs plain."""
        running = scheduler.running
        batch_size, controller, ngram, shadow = len(running), self.controller, self.ngram, self.shadow
        retry = not self._shadowing     # a probe of a shadowed bucket: the estimates are current
        drafts: dict[str, list[int]] = {}
        drafted = []
        for request in running:
            tokens = request.token_ids
            if len(tokens) - request.num_computed_tokens != 1 or request.status is not _RUNNING:
                continue          # a prefill chunk
            params = request.sampling_params
            if params.structured is not None:
                continue          # a grammar's drafts would need its matcher (not here)
            # Every emitted token must fit max_tokens and the context: k + 1 tokens at most.
            limit = min(params.max_tokens - len(request.output_token_ids), self.max_model_len - len(tokens)) - 1
            k = controller.num_drafts(request, batch_size, limit, retry)
            if k <= 0:
                continue
            proposed = ngram.propose(request, k) if ngram is not None else [_SLOT] * k
            if proposed:
                drafts[request.request_id] = proposed
                drafted.append((request, len(proposed)))
        if drafts and controller.declines(batch_size, drafted):
            return None
        if shadow is not None:
            for request, _ in drafted:
                shadow.forget(request)
        return drafts

    def fill(self, seqs: tuple, requests: list) -> tuple:
        """The seqs the target runs: with the draft model's drafts in their slots (n-gram: as they are)."""
        if self.draft is None:
            return seqs
        pairs = [(request, seq) for seq, request in zip(seqs, requests) if seq[4] > 1]
        drafts = self.draft.propose(pairs)
        if not drafts:
            return seqs
        return tuple(seq if seq[0] not in drafts else seq._replace(token_ids=(seq[1][0], *drafts[seq[0]]))
                     for seq in seqs)

    def verify(self, sampler: Sampler, logits: torch.Tensor, seqs, requests, grammar=None) -> Verified:
        """`grammar`: the rows' structured-output masks (`rejection_sampler.verify`)."""
        verified = verify(sampler, logits, seqs, requests, grammar)
        stats, controller = self.stats, self.controller
        by_id = {request.request_id: request for request in requests} if verified.drafts else {}
        for request_id, drafts in verified.drafts.items():
            accepted = verified.accepted[request_id]
            stats.record(len(drafts), accepted)
            controller.observe_acceptance(by_id[request_id], len(drafts), accepted)
        return verified

    def settle(self, requests) -> None:
        """After `update`: the draft's KV past each request's accepted tokens is stale."""
        if self.draft is not None:
            for request in requests:
                self.draft.settle(request)

    def observe_step(self, out, seconds: float, num_emitted: int, speculative: bool) -> None:
        """Time a decode-only step (steps with a prefill chunk say nothing about decode rates)."""
        seqs = out.scheduled
        num_draft_tokens = out.num_batched_tokens - len(seqs)
        if speculative:
            if any(len(seq[1]) > 1 and not seq[4] > 1 for seq in seqs):   # a prefill chunk
                return
        elif num_draft_tokens:
            return
        self.controller.observe_step(len(seqs), seconds, num_emitted, num_draft_tokens, speculative)
