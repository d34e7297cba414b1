"""A pod's draft model in P/D (issue 25): what it advertises, and which cache a pull reads or writes.

A prefill pod with a draft model (`engine.spec_decode.draft_prefill`) and a decode pod that
speculates with one both advertise the draft's KV layout in their `ModelInfo.draft_kv`; a pull
between two pods whose drafts agree carries the draft's blocks beside the target's
(`kvtransfer.draft_kv`). An EAGLE head advertises nothing: its KV depends on the target's hidden
states of the decode pod's own forwards, so it catches up there.
"""

from __future__ import annotations

import logging

import torch

from wire import cbserve_pb2
from engine.engine import Engine
from engine.loader import model_fingerprint
from engine.spec_decode.draft_model import DraftModelProposer
from kvtransfer.draft_kv import draft_kv_info, draft_mismatch

log = logging.getLogger(__name__)
_warned: set[str] = set()


def advertise_draft_kv(engine: Engine, model_info: cbserve_pb2.ModelInfo) -> torch.Tensor | None:
    """The engine's draft model cache whose KV can travel (None: none), its layout set in `model_info`."""
    if engine.draft_prefill is not None:
        kv, fingerprint = engine.draft_prefill.kv_cache, engine.draft_prefill.fingerprint
    elif engine.spec is not None and type(engine.spec.draft) is DraftModelProposer:
        kv, fingerprint = engine.spec.draft.kv_cache, model_fingerprint(engine.spec.draft.model_dir)
    else:
        return None
    model_info.draft_kv.CopyFrom(draft_kv_info(kv, fingerprint))
    return kv


def shipped_draft_kv(draft_kv: torch.Tensor | None, ours: cbserve_pb2.ModelInfo, theirs: cbserve_pb2.ModelInfo,
                     start_block_index: int) -> torch.Tensor | None:
    """Prefill pod: the draft cache a pull ships beside the target's blocks, or None (the decode pod
    then prefills its draft itself): the puller's draft must be this pod's, and the pull must start
    at block 0 (a windowed pull skips blocks that the draft, reading every token, still needs)."""
    if draft_kv is None or start_block_index or not theirs.HasField("draft_kv"):
        return None
    problem = draft_mismatch(ours, theirs)
    if problem is not None:
        if problem not in _warned:   # a misconfigured pool: said once, not on every pull
            _warned.add(problem)
            log.warning("a decode pod's draft model is not this pod's (%s): it prefills its own draft", problem)
        return None
    return draft_kv
