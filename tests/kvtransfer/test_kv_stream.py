"""KVSource and KVSink state machines without a network: events in, chunks out, and every way
a chunk stream can be wrong."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvtransfer.errors import (ChecksumError, LayoutError, ProtocolError, SourceAbortedError,
                               StreamEndedError)
from kvtransfer.grpc_transport import KVSink, KVSource
from kvtransfer.progress import ComputedTokens, FirstToken, KVProgress

from kv_helpers import TINY, make_kv, same_bytes

pytestmark = pytest.mark.timeout(30)


async def aiter_of(items):
    for item in items:
        yield item


def source_chunks(events, num_prompt_tokens=22, **kwargs):
    source = KVSource(make_kv(), "r", num_prompt_tokens, **kwargs)

    async def collect():
        return [chunk async for chunk in source.chunks(aiter_of(events))]

    return asyncio.run(collect())


def test_source_holds_back_the_partial_block_until_the_first_token():
    ids = (1, 2, 3, 4, 5, 6)
    chunks = source_chunks([ComputedTokens(5, ids[:2]), ComputedTokens(22, ids), FirstToken(9, ids)])
    shapes = [(c.first_block_index, c.num_blocks, c.num_computed_tokens, c.last) for c in chunks]
    assert shapes == [(0, 1, 4, False), (1, 4, 20, False), (5, 1, 22, True)]
    assert chunks[-1].first_token_id == 9 and all(c.num_prompt_tokens == 22 for c in chunks)


def test_source_sends_an_empty_last_message_when_nothing_is_left():
    ids = (1, 2, 3)
    chunks = source_chunks([ComputedTokens(12, ids), FirstToken(3, ids)], num_prompt_tokens=12)
    assert [(c.first_block_index, c.num_blocks, c.last) for c in chunks] == [(0, 3, False), (3, 0, True)]
    assert chunks[-1].data == b"" and chunks[-1].num_bytes == 0


def test_source_refuses_a_rewritten_block_table():
    with pytest.raises(LayoutError, match="block table changed"):
        source_chunks([ComputedTokens(8, (1, 2)), ComputedTokens(12, (1, 7, 3))])


def test_source_without_first_token_is_aborted():
    with pytest.raises(SourceAbortedError, match="without a first token"):
        source_chunks([ComputedTokens(8, (1, 2))])


def test_progress_coalesces_and_replays_state_for_late_pulls():
    async def scenario():
        progress = KVProgress(num_prompt_tokens=10)
        progress.advance(4, [1])
        progress.advance(8, [1, 2])  # a late consumer sees only the latest state
        events = progress.events()
        first = await anext(events)
        progress.finish(5, [1, 2, 3])
        second = await anext(events)
        return first, second

    first, second = asyncio.run(scenario())
    assert first == ComputedTokens(8, (1, 2))
    assert isinstance(second, FirstToken) and second.token_id == 5 and second.block_ids == (1, 2, 3)


def test_progress_from_another_thread_and_failure():
    async def scenario():
        progress = KVProgress(num_prompt_tokens=10)
        seen = []

        async def consume():
            async for event in progress.events():
                seen.append(event)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.01)
        await asyncio.to_thread(progress.advance, 4, [1])
        while not seen:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(progress.fail, "preempted")
        with pytest.raises(SourceAbortedError, match="preempted"):
            await task
        return seen

    assert asyncio.run(scenario()) == [ComputedTokens(4, (1,))]


def good_chunks():
    src = make_kv()
    ids = (1, 2, 3, 4, 5, 6)
    return src, source_chunks([ComputedTokens(22, ids), FirstToken(9, ids)],
                              max_chunk_bytes=2 * TINY.bytes_per_block)


def consume(chunks, num_prompt_tokens=22, dst_ids=(9, 10, 11, 2, 3, 4)):
    dst = torch.zeros((16, *TINY.block_shape))
    sink = KVSink(dst, list(dst_ids), "r", num_prompt_tokens)
    return dst, asyncio.run(sink.consume(aiter_of(chunks)))


def test_sink_round_trip():
    src, chunks = good_chunks()
    dst, result = consume(chunks)
    assert result.num_blocks == 6 and result.first_token_id == 9
    assert all(same_bytes(src[s], dst[d]) for s, d in zip((1, 2, 3, 4, 5, 6), (9, 10, 11, 2, 3, 4)))


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (lambda cs: cs[:1] + cs[2:], ProtocolError, "gap: chunk starts at block 4, expected 2"),
        (lambda cs: cs[:2] + cs[1:], ProtocolError, "duplicate"),
        (lambda cs: cs[:-1], StreamEndedError, "without its last message"),
        (lambda cs: [_edit(cs[0], request_id="other")] + cs[1:], ProtocolError, "request 'other'"),
        (lambda cs: [_edit(cs[0], num_bytes=1)] + cs[1:], LayoutError, "chunk says 1 bytes"),
        (lambda cs: [_edit(cs[0], data=cs[0].data[:-4])] + cs[1:], LayoutError, "payload has"),
        (lambda cs: [_edit(cs[0], crc32=cs[0].crc32 ^ 1)] + cs[1:], ChecksumError, "crc32"),
        (lambda cs: [_edit(cs[0], num_prompt_tokens=30)] + cs[1:], LayoutError, "prompt tokens"),
        (lambda cs: cs[:1] + [_edit(cs[1], last=True)], ProtocolError, "last message after 4/6"),
    ],
)
def test_sink_refuses_bad_streams(mutate, error, message):
    _, chunks = good_chunks()
    with pytest.raises(error, match=message):
        consume(mutate(chunks))


def test_sink_refuses_too_few_destination_blocks():
    with pytest.raises(LayoutError, match="cannot hold 22 prompt tokens"):
        KVSink(torch.zeros((16, *TINY.block_shape)), [1, 2, 3], "r", 22)


def _edit(chunk, **fields):
    copy = type(chunk)()
    copy.CopyFrom(chunk)
    for name, value in fields.items():
        setattr(copy, name, value)
    return copy


def test_window_start_skips_the_blocks_behind_it_on_both_sides():
    """Every layer windowed: the source sends, and the sink writes, only the blocks from
    `start_block_index` on; entries before it may change (freed: null) under the stream, entries
    from it on may not, and a freed block the puller asks for is refused rather than sent."""
    src, ids = make_kv(), (1, 2, 3, 4, 5, 6)
    freed = (0, 0, 0, 4, 5, 6)        # the prefill pod freed blocks 0..2 as its prefill went on
    chunks = source_chunks([ComputedTokens(8, ids), ComputedTokens(16, freed), FirstToken(9, freed)],
                           start_block_index=3)
    assert [(c.first_block_index, c.num_blocks, c.last) for c in chunks] == [(3, 1, False), (4, 2, True)]
    dst = torch.zeros((16, *TINY.block_shape))
    sink = KVSink(dst, [0, 0, 0, 9, 10, 11], "r", 22, start_block_index=3)
    result = asyncio.run(sink.consume(aiter_of(chunks)))
    assert result.num_blocks == 3 and result.num_bytes == 3 * TINY.bytes_per_block
    assert all(same_bytes(src[s], dst[d]) for s, d in zip((4, 5, 6), (9, 10, 11)))
    assert not dst[0].any()                                  # the null block is never written
    with pytest.raises(LayoutError, match="block table changed"):
        source_chunks([ComputedTokens(16, (0, 0, 0, 4, 5)), ComputedTokens(20, (0, 0, 0, 7, 5, 6))],
                      start_block_index=3)
    with pytest.raises(LayoutError, match="freed behind the sliding window"):
        source_chunks([ComputedTokens(22, (0, 0, 0, 4, 5, 6)), FirstToken(9, (0, 0, 0, 4, 5, 6))],
                      start_block_index=2)
    with pytest.raises(ProtocolError, match="duplicate"):   # a source that sends from 0 to a windowed sink
        asyncio.run(KVSink(dst, [0, 0, 0, 9, 10, 11], "r", 22, start_block_index=3).consume(
            aiter_of(good_chunks()[1])))


# KV groups (kvtransfer/kv_groups.py): group 0 every block, group 1 from block 4 (its window's start).
GROUP_IDS = ((1, 2, 3, 4, 5, 6), (0, 0, 0, 0, 7, 8))   # group 1's entries before its start were freed


def group_chunks():
    return source_chunks([ComputedTokens(16, GROUP_IDS[0][:4], (GROUP_IDS[1][:4],)),
                          FirstToken(9, GROUP_IDS[0], group_block_ids=(GROUP_IDS[1],))],
                         group_start_block_indices=(4,))


def consume_groups(chunks):
    dst = torch.zeros((16, *TINY.block_shape))
    sink = KVSink(dst, [9, 10, 11, 12, 13, 14], "r", 22, group_dst_block_ids=([0, 0, 0, 0, 2, 3],),
                  group_start_block_indices=(4,))
    return dst, asyncio.run(sink.consume(aiter_of(chunks)))


def test_groups_stream_each_group_from_its_start_and_last_after_all():
    chunks = group_chunks()
    # Group 1 has nothing to send before block 4 is computed; the last message follows its pages.
    assert [(c.kv_group, c.first_block_index, c.num_blocks, c.last) for c in chunks] == \
        [(0, 0, 4, False), (0, 4, 2, False), (1, 4, 2, True)]
    dst, result = consume_groups(chunks)
    assert result.num_blocks == 6 + 2 and result.first_token_id == 9
    src = make_kv()
    pairs = list(zip(GROUP_IDS[0], (9, 10, 11, 12, 13, 14))) + [(7, 2), (8, 3)]
    assert all(same_bytes(src[s], dst[d]) for s, d in pairs)


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (lambda cs: cs[:2] + [_edit(cs[2], kv_group=2)], ProtocolError, "KV group 2, this pod has 2"),
        (lambda cs: [cs[0], _edit(cs[1], last=True)], ProtocolError, "last message after 4/6 blocks of KV group 1"),
        (lambda cs: cs[:2] + [_edit(cs[2], first_block_index=5)], ProtocolError, r"gap.*\(KV group 1\)"),
    ],
)
def test_sink_refuses_bad_group_streams(mutate, error, message):
    with pytest.raises(error, match=message):
        consume_groups(mutate(group_chunks()))


def test_source_refuses_a_freed_page_or_a_missing_group_table():
    with pytest.raises(LayoutError, match="freed behind the sliding window"):
        source_chunks([FirstToken(9, GROUP_IDS[0], group_block_ids=(GROUP_IDS[1],))], group_start_block_indices=(3,))
    with pytest.raises(LayoutError, match="reports 1 KV group"):
        source_chunks([FirstToken(9, GROUP_IDS[0])], group_start_block_indices=(4,))
