"""A draft model's KV beside the target's in one `PullKV` stream (issue 25: P/D with a draft model).

A decode pod that speculates with a draft model needs the draft's KV of the prompt. A prefill
pod given the same draft prefills it beside the target (`engine.spec_decode.draft_prefill`) and
ships it in the target's stream. The draft's cache has a block for every target block under the
same block tables (`engine.spec_decode.draft_model`), so each run of the target's blocks is the
same run of the draft's blocks: packed, checksummed and written like the target's (`packing`),
in the same message (gRPC: `KVChunk.draft_data`) or right after the target's bytes on the pair's
process group (under `draft_stream_id`). One stream is one lease: a cancel or a failure ends both.

Whether a stream ships the draft is the prefill pod's choice at its start (`draft_mismatch`):
only when the puller advertised a draft (`ModelInfo.draft_kv`) of the same weights and layout as
its own. Otherwise the decode pod prefills its draft itself: a mismatch costs time, never a
wrong answer.
"""

from __future__ import annotations

import torch

from wire import cbserve_pb2
from kvtransfer.layout import KVLayout

# The process-group frames of a request's draft runs go under this id (`PairGroup` keys frames by
# request and block index: the draft's run k must not be taken for the target's run k).
_DRAFT_SUFFIX = "\x00draft"


def draft_stream_id(request_id: str) -> str:
    return request_id + _DRAFT_SUFFIX


def draft_kv_info(kv: torch.Tensor, model_fingerprint: str) -> cbserve_pb2.DraftKvInfo:
    """What a pod advertises of its draft's cache `kv` (`ModelInfo.draft_kv`)."""
    layout = KVLayout.from_tensor(kv)
    return cbserve_pb2.DraftKvInfo(model_fingerprint=model_fingerprint, kv_dtype=layout.dtype_name,
                                   num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                                   head_dim=layout.head_dim)


def draft_mismatch(ours: cbserve_pb2.ModelInfo, theirs: cbserve_pb2.ModelInfo) -> str | None:
    """None if the pods' drafts have the same weights and KV layout (the draft's KV can travel),
    else why not (no draft on a side, or what differs). The block size is the target's, which
    `layout.check_compatible` compares."""
    if not ours.HasField("draft_kv") or not theirs.HasField("draft_kv"):
        side = "here" if not ours.HasField("draft_kv") else "there"
        return f"no draft model {side}"
    a, b = ours.draft_kv, theirs.draft_kv
    if not a.model_fingerprint:
        return "the draft's fingerprint is empty"
    differences = [f"{name}: {getattr(a, name)!r} here vs {getattr(b, name)!r} there"
                   for name in ("model_fingerprint", "kv_dtype", "num_layers", "num_kv_heads", "head_dim")
                   if getattr(a, name) != getattr(b, name)]
    return "; ".join(differences) or None
