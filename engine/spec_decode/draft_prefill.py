"""The draft model on a prefill pod: its KV of every prompt, shipped to the decode pod (issue 25).

With `--speculative-config` method `draft_model`, a prefill engine loads the draft too and runs
it over each step's prefill chunks in the same step, after the target's forward and sample (on a
GPU the first tokens are on the host before the draft's kernels run), into its own paged cache
under the target's block tables (the layout the decode side uses: `engine.spec_decode.draft_model`).
So the draft's KV of a prompt is complete when the step that completes the target's ends: the pull that ships the target's
blocks ships the draft's same blocks beside them (`kvtransfer.draft_kv`), and the decode pod lands
them and skips the draft's catch-up over the prompt (`DraftModelProposer.received`).

Opt-in (a prefill pod runs it only when given the config). Moving the draft's KV costs 6-60x
less than recomputing it (`bench/draft_kv.py`), but this pod pays the draft's prefill on every
prompt, where the decode pod's catch-up is lazy (only once it speculates for the request): end to
end on CPU with a draft as large as the target, shipping doubled the time to the first token and
saved nothing measurable (`bench/draft_kv_pd.py`, docs/benchmarks.md).

Prefix-cache hits need nothing: every block this engine computed, both models computed (the
only forwards a prefill engine runs are prefill chunks, and each one is paired). Freeing,
preemption and aborts free both caches' blocks at once, since the tables are shared.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.config import CacheConfig
from engine.loader import model_fingerprint
from engine.model_config import ModelConfig
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_model import DraftModelProposer, fit_cache

log = logging.getLogger(__name__)


class DraftPrefill:
    """A prefill engine's draft model: `fit_cache` and `allocate` as the engine sizes its KV,
    then `run` every step's scheduled chunks."""

    def __init__(self, draft: DraftModelProposer) -> None:
        self.draft = draft
        self.fingerprint = model_fingerprint(draft.model_dir)

    @classmethod
    def create(cls, config: SpeculativeConfig | None, role: str, target_dir: Path, target_cfg: ModelConfig,
               dtype: torch.dtype, device: torch.device, max_model_len: int, max_num_seqs: int,
               max_num_batched_tokens: int) -> DraftPrefill | None:
        """A prefill engine given a draft model; None otherwise (n-gram and EAGLE need nothing here:
        an EAGLE head reads the target's hidden states of the decode pod's own forwards)."""
        if config is None or role != "prefill" or config.method != "draft_model":
            return None
        log.info("draft model %s: its KV of every prompt is computed here and shipped with the target's",
                 config.model)
        return cls(DraftModelProposer(config.model, target_dir, target_cfg, dtype, device, max_model_len,
                                      max_num_seqs, max_num_batched_tokens))

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.draft.kv_cache

    def fit_cache(self, sized: CacheConfig, requested: CacheConfig, target_cfg: ModelConfig,
                  kv_dtype: torch.dtype) -> CacheConfig:
        return fit_cache(self.draft, sized, requested, target_cfg, kv_dtype)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.draft.allocate(num_blocks, block_size)

    def run(self, scheduled) -> None:
        """The draft's forward over a step's chunks (same tokens, positions and block tables as the
        target's): its KV lands in the same blocks of its own cache. Its logits are not read."""
        self.draft.runner.run(scheduled)
