"""`StepInputs`: 16-byte-aligned fields, memoised layouts and cached views, and the incremental
block table: a staging buffer reused across steps plans exactly what a fresh one plans."""

from __future__ import annotations

import random

import pytest
import torch

from engine.scheduling.output import PLACEHOLDER_TOKEN_ID, ScheduledSeq
from engine.step_inputs import ALIGN, Layout, PrevSample, StepInputs, max_layout_bytes

BLOCK = 4
CPU = torch.device("cpu")
FIELDS = ("input_ids", "positions", "logits_indices", "fill_dst", "fill_src")


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 0), (3, 3, 5, 3, 3), (37, 5, 7, 2, 1), (256, 256, 512, 256, 256)])
def test_every_field_starts_16_byte_aligned(shape):
    layout = Layout(*shape)
    assert all(offset % ALIGN == 0 for _, _, _, offset, _ in layout.offsets())
    assert layout.offsets() is Layout(*shape).offsets()      # memoised: computed once per layout


def _snapshot(t) -> dict:
    m = t.meta
    out = {name: getattr(t, name).tolist() for name in FIELDS}
    out.update(slots=m.slot_mapping.tolist(), qsl=m.query_start_loc.tolist(), seq_lens=m.seq_lens.tolist(),
               tables=m.block_tables.tolist(), num_seqs=t.num_seqs, fill_in_order=t.fill_in_order)
    return out


@pytest.mark.parametrize("padded", [True, False])
def test_a_reused_buffer_plans_what_a_fresh_one_plans(padded):
    """Decode steps as the scheduler makes them (a request's table is the same tuple until it gains
    a block), with arrivals, departures, reorders and padding (`padded`: the graphs' buckets and
    width; else the eager runner's), some tokens still on the device. Batches this small that
    repeat the previous step's requests in its sample's order are staged element by element
    (`StepInputs._prepare_steady`): that path must run, and plan the same."""
    rng = random.Random(3)
    staging = StepInputs(max_layout_bytes(16, 16, 8), BLOCK, CPU, growable=False)
    steady = staging._prepare_steady
    num_steady = 0

    def counted(*args):
        nonlocal num_steady
        t = steady(*args)
        num_steady += t is not None
        return t

    staging._prepare_steady = counted
    tables: dict[str, tuple[int, ...]] = {}
    lengths: dict[str, int] = {}
    next_block = 1
    for step in range(300):
        if len(tables) < 12 and rng.random() < 0.3:                 # an arrival
            rid = f"r{step}"
            lengths[rid] = rng.randrange(1, 8)
            tables[rid] = tuple(range(next_block, next_block + -(-lengths[rid] // BLOCK)))
            next_block += len(tables[rid])
        if tables and rng.random() < 0.1:                          # a departure
            rid = rng.choice(sorted(tables))
            del tables[rid], lengths[rid]
        for rid in list(tables):                                   # every request decodes one token
            if lengths[rid] >= 30:
                continue
            lengths[rid] += 1
            if -(-lengths[rid] // BLOCK) > len(tables[rid]):        # gains a block: a new tuple
                tables[rid] = tables[rid] + (next_block,)
                next_block += 1
        order = sorted(tables)
        if rng.random() < 0.1:
            rng.shuffle(order)
        on_device = rng.choice([lambda i: True] * 4 + [lambda i: i % 2 == 1, lambda i: False])   # all, some, none
        batch = [ScheduledSeq(rid, (PLACEHOLDER_TOKEN_ID if on_device(i) else rng.randrange(100),), lengths[rid] - 1,
                              tables[rid], True) for i, rid in enumerate(order)]
        # The previous sample in reverse order (a gather), or known by its ids: mostly in this order (a copy).
        prev = {rid: j for j, rid in enumerate(reversed(order))} if step % 4 == 0 else \
            PrevSample(None, ids=list(reversed(order)) if step % 9 == 0 else list(order))
        pad = (16 if step % 7 else len(batch) + rng.randrange(3)) if padded else None   # mostly one bucket
        width = 8 if padded else None
        got = _snapshot(staging.prepare(batch, pad_to=pad, width=width, prev_rows=prev))
        fresh = StepInputs(max_layout_bytes(16, 16, 8), BLOCK, CPU, growable=False)
        assert got == _snapshot(fresh.prepare(batch, pad_to=pad, width=width, prev_rows=prev)), step
    assert num_steady > 20


def test_a_mixed_step_between_decodes_rewrites_the_table():
    staging = StepInputs(max_layout_bytes(32, 8, 8), BLOCK, CPU)
    decodes = [ScheduledSeq("a", (5,), 6, (3, 4), True), ScheduledSeq("b", (6,), 2, (7,), True)]
    first = _snapshot(staging.prepare(decodes, pad_to=4, width=4))
    staging.prepare([ScheduledSeq("c", tuple(range(9)), 0, (9, 10, 11), True)] + decodes)
    assert _snapshot(staging.prepare(decodes, pad_to=4, width=4)) == first


@pytest.mark.parametrize("by_ids", [False, True])
@pytest.mark.parametrize("rows", [{"a": 0, "b": 1, "c": 2}, {"a": 2, "b": 0, "c": 1}])
def test_tokens_on_the_device_fill_in_order_or_by_gather(rows, by_ids):
    """A steady batch (same requests, same order) copies the previous sample as it is; any other
    order gathers it. Both put each request's token in its row, whether the sample's rows come as
    a map or as its ids (`PrevSample`: compared in order, the map built only for a gather)."""
    staging = StepInputs(max_layout_bytes(8, 8, 4), BLOCK, CPU, growable=False)
    batch = [ScheduledSeq(rid, (PLACEHOLDER_TOKEN_ID,), 3, (1 + i,), True) for i, rid in enumerate("abc")]
    prev_rows = PrevSample(None, ids=sorted(rows, key=rows.get)) if by_ids else rows
    t = staging.prepare(batch, pad_to=4, width=4, prev_rows=prev_rows)
    assert t.fill_in_order == (rows == {"a": 0, "b": 1, "c": 2})
    prev = torch.tensor([70, 71, 72])
    t.fill_from(prev)
    assert t.input_ids.tolist() == [70 + rows[rid] for rid in "abc"] + [0]
