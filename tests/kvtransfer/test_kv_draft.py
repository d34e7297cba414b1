"""A draft model's KV in the target's stream (`kvtransfer.draft_kv`): every run's draft blocks land
byte-exact in the draft's cache beside the target's, in the same messages; a source without the
draft leaves the puller to prefill its own; a stream that ships it to a pod without a draft, in
some chunks only, or corrupted, is refused; the pods' drafts must agree. (The Gloo pair's path
runs between real pods: tests/pods/test_spec_decode_pd.py.)"""

from __future__ import annotations

import asyncio

import pytest
import torch

from wire import cbserve_pb2
from kvtransfer.draft_kv import draft_kv_info, draft_mismatch
from kvtransfer.errors import ChecksumError, ProtocolError
from kvtransfer.grpc_transport import KVSink, KVSource
from kvtransfer.layout import KVLayout
from kvtransfer.progress import KVProgress

from kv_helpers import TINY, make_kv, same_bytes

pytestmark = pytest.mark.timeout(60)

DRAFT = KVLayout(num_layers=1, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)
SRC_IDS = [3, 4, 5, 9, 10, 11]     # 22 tokens at block size 4: 6 blocks, the last partial
DST_IDS = [15, 1, 2, 7, 8, 6]


def _transfer(draft_src: bool, draft_dst: bool, chunk_filter=None):
    """Prefill progress -> KVSource -> (each chunk through `chunk_filter`) -> KVSink."""
    src, src_draft = make_kv(TINY, seed=1), make_kv(DRAFT, seed=2)
    dst, dst_draft = torch.zeros_like(src), torch.zeros_like(src_draft)

    async def go():
        progress = KVProgress(22)
        source = KVSource(src, "r", 22, max_chunk_bytes=2 * (TINY.bytes_per_block + DRAFT.bytes_per_block),
                          draft_kv=src_draft if draft_src else None)
        sink = KVSink(dst, DST_IDS, "r", 22, draft_kv=dst_draft if draft_dst else None)
        progress.advance(13, SRC_IDS[:4])
        progress.finish(7, SRC_IDS, None, "", None)

        async def chunks():
            async for chunk in source.chunks(progress.events()):
                yield chunk_filter(chunk) if chunk_filter else chunk
        result = await sink.consume(chunks())
        return result, source

    result, source = asyncio.run(go())
    return result, source, (src, src_draft, dst, dst_draft)


def _landed(cache: torch.Tensor, copy: torch.Tensor) -> bool:
    return all(same_bytes(cache[s], copy[d]) for s, d in zip(SRC_IDS, DST_IDS))


def test_the_drafts_blocks_land_beside_the_targets_in_messages_of_both():
    result, source, (src, src_draft, dst, dst_draft) = _transfer(True, True)
    assert result.draft_kv and result.first_token_id == 7
    assert _landed(src, dst) and _landed(src_draft, dst_draft)
    both = 6 * (TINY.bytes_per_block + DRAFT.bytes_per_block)
    assert result.num_bytes == source.num_bytes_sent == both


def test_a_source_without_the_draft_leaves_the_pullers_draft_to_prefill_itself():
    result, _, (src, _, dst, dst_draft) = _transfer(False, True)
    assert not result.draft_kv and _landed(src, dst)
    assert not dst_draft.any()


def test_draft_kv_the_puller_cannot_use_is_refused():
    with pytest.raises(ProtocolError, match="without a draft"):
        _transfer(True, False)

    seen = []

    def drop_after_first(chunk):
        seen.append(chunk)
        if len(seen) > 1:
            chunk.draft_kv, chunk.draft_data = False, b""
        return chunk
    with pytest.raises(ProtocolError, match="some chunks"):
        _transfer(True, True, chunk_filter=drop_after_first)

    def corrupt(chunk):
        if chunk.draft_data:
            chunk.draft_crc32 ^= 1
        return chunk
    with pytest.raises(ChecksumError):
        _transfer(True, True, chunk_filter=corrupt)


def test_the_pods_drafts_must_have_the_same_weights_and_layout():
    def info(fingerprint="fp-draft", layout=DRAFT, draft=True):
        model = TINY.to_model_info("tiny", "fp-tiny")
        if draft:
            model.draft_kv.CopyFrom(draft_kv_info(make_kv(layout, num_blocks=2), fingerprint))
        return model
    assert draft_mismatch(info(), info()) is None
    assert "no draft model here" == draft_mismatch(info(draft=False), info())
    assert "no draft model there" == draft_mismatch(info(), info(draft=False))
    assert "model_fingerprint: 'fp-draft' here vs 'other' there" == draft_mismatch(info(), info("other"))
    wide = KVLayout(num_layers=1, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    assert "num_kv_heads: 1 here vs 2 there" == draft_mismatch(info(), info(layout=wide))
    assert isinstance(info().draft_kv, cbserve_pb2.DraftKvInfo)
