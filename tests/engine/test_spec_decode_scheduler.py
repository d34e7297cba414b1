"""Drafts in the scheduler and the step inputs, with hand-made requests (no model).

A decode with k drafts is one `1 + k`-token chunk that samples its last `1 + k` rows; drafts take
only the budget and blocks the batch can spare (never a preemption, never the last free blocks);
after verification `num_computed_tokens` counts the accepted tokens only, rejected slots stay in
the request's blocks and are overwritten, and nothing leaks.
"""

from __future__ import annotations

import torch

from engine.scheduling.output import ScheduledSeq
from engine.step_inputs import StepInputs, max_layout_bytes
from tests.engine.test_scheduler import make_request, make_scheduler, step


def _decoding(s, *requests):
    """Admit `requests` and prefill them (each gets one sampled token)."""
    for r in requests:
        s.add_request(r)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests):
        step(s)


def _verify_step(s, drafts, emitted):
    out = s.schedule(drafts)
    updated = s.update(out, {seq.request_id: (emitted[seq.request_id] if seq.sample > 1 else 7)
                             for seq in out.scheduled if seq.sample})
    s.check_invariants()
    return out, updated


def test_drafts_ride_as_extra_query_tokens_and_only_accepted_ones_count():
    s = make_scheduler(budget=32, block_size=4)
    a, b = make_request("a", num_prompt=6, max_tokens=20), make_request("b", num_prompt=6, max_tokens=20)
    _decoding(s, a, b)
    n = a.num_computed_tokens                       # 6: the prompt; the first token is not computed yet
    out, updated = _verify_step(s, {"a": [31, 32, 33]}, {"a": [31, 32, 40]})
    seq_a, seq_b = out.scheduled
    assert seq_a.token_ids == (a.token_ids[n], 31, 32, 33) and seq_a.sample == 4 and seq_a.start_position == n
    assert seq_b.sample is True and len(seq_b.token_ids) == 1
    assert out.num_batched_tokens == 5
    # two drafts accepted, then 40 sampled: n + 1 (the step's input) + 2 computed
    assert a.num_computed_tokens == n + 3 and a.output_token_ids[-3:] == [31, 32, 40]
    assert len(a.token_ids) == a.num_computed_tokens + 1
    assert len(a.block_ids) * s.block_size >= n + 4       # the slot of the rejected draft is kept, reused
    assert updated == [a, b]


def test_drafts_shrink_to_the_budget_and_never_preempt():
    s = make_scheduler(budget=6, block_size=4, num_blocks=64)
    a, b = make_request("a", num_prompt=4, max_tokens=20), make_request("b", num_prompt=4, max_tokens=20)
    _decoding(s, a, b)
    out = s.schedule({"a": [1, 2, 3, 4, 5, 6, 7], "b": [9, 9]})
    assert [len(seq.token_ids) for seq in out.scheduled] == [5, 1]   # 6 tokens: b's decode keeps its own
    assert out.preempted_request_ids == ()
    s.update(out, {"a": [1, 2], "b": 7})
    s.check_invariants()


def test_drafts_keep_a_free_block_per_running_request():
    # 4 usable blocks: a and b hold one each (4-token prompts fill them); 2 stay free for the two
    # requests' next blocks. Drafts that need a new block must leave both.
    s = make_scheduler(budget=32, block_size=4, num_blocks=5, max_model_len=16)
    a, b = make_request("a", num_prompt=3, max_tokens=6), make_request("b", num_prompt=3, max_tokens=6)
    _decoding(s, a, b)                          # 3 prompt tokens + the first token: one block each
    assert s.kv_manager.num_free_blocks == 2
    out = s.schedule({"a": [5, 6, 7], "b": [5, 6, 7]})
    # a decode at position 3 fits its first block; drafts at 4..6 would need a new block each, and
    # 2 free - 1 < 2 running: the drafts shrink to what the block holds (none)
    assert [len(seq.token_ids) for seq in out.scheduled] == [1, 1]
    assert s.kv_manager.num_free_blocks == 2
    s.update(out, {"a": 7, "b": 7})


def test_a_stop_among_the_emitted_tokens_drops_the_rest_and_frees_everything():
    s = make_scheduler(budget=32, block_size=4)
    a = make_request("a", num_prompt=5, max_tokens=20, stop_token_ids=[99])
    b = make_request("b", num_prompt=5, max_tokens=4)
    _decoding(s, a, b)
    free = s.kv_manager.num_free_blocks
    out, updated = _verify_step(s, {"a": [10, 99, 11], "b": [11, 12, 13]},
                                {"a": [10, 99, 11, 12], "b": [11, 12, 13]})
    assert a.output_token_ids[-2:] == [10, 99] and a.status.finish_reason == "stop" and a.stop_reason == 99
    # b reaches max_tokens (4) with its last emitted token
    assert b.output_token_ids == [7, 11, 12, 13] and b.status.finish_reason == "length"
    assert s.kv_manager.num_free_blocks > free and not s.running
    assert s.kv_manager.block_pool.num_free_blocks == s.kv_manager.block_pool.num_usable_blocks


def test_preempted_victims_get_no_drafts():
    s = make_scheduler(budget=64, block_size=4, num_blocks=6, max_model_len=24, max_seqs=4)
    reqs = [make_request(r, num_prompt=4, max_tokens=16) for r in "abc"]
    _decoding(s, *reqs)
    for _ in range(12):                         # grow until the pool runs short and preempts
        out = s.schedule({r.request_id: [5, 6] for r in s.running})
        emitted = {seq.request_id: [5, 6, 8] for seq in out.scheduled if seq.sample > 1}
        s.update(out, {seq.request_id: emitted.get(seq.request_id, 7) for seq in out.scheduled if seq.sample})
        s.check_invariants()
        if out.preempted_request_ids:
            victims = set(out.preempted_request_ids)
            assert all(seq.request_id not in victims for seq in out.scheduled)
            return
    raise AssertionError("the pool never ran short")


def test_step_inputs_sample_the_last_rows_of_each_verification():
    staging = StepInputs(max_layout_bytes(64, 8, 8), 4, torch.device("cpu"))
    seqs = [ScheduledSeq("a", (5,), 9, (1, 2, 3), True),          # a plain decode: its token's row
            ScheduledSeq("b", (6, 7, 8, 9), 4, (4, 5), 4),        # a decode with 3 drafts: 4 rows
            ScheduledSeq("c", (1, 2, 3), 0, (6,), False),         # a prefill chunk: no row
            ScheduledSeq("d", (4, 5), 3, (7, 8), 2)]              # 1 draft: 2 rows
    t = staging.prepare(seqs)
    assert t.logits_indices.tolist() == [0, 1, 2, 3, 4, 8, 9]
    assert t.positions.tolist() == [9, 4, 5, 6, 7, 0, 1, 2, 3, 4]
    assert t.meta.seq_lens.tolist() == [10, 8, 3, 5]
    assert t.meta.slot_mapping.tolist()[1:5] == [5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3]
