"""Verification at the logits level: emitted tokens follow the target distribution exactly.

On a small vocabulary with fixed target rows, many seeds: the first emitted token is distributed
as the target's row 0 (chi-square), the second (once the first draft is accepted) as row 1, a
draft is accepted with probability p(draft), and a rejection emits from p without the draft,
renormalised (the textbook rejection sampler's residual, `norm(max(p - q, 0))` with q the draft's
point mass). Seeded rows draw exactly what the non-speculative sampler draws at the same output
position, and penalties / min_tokens see the drafts before each row as outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine.sampling.sampler import Sampler
from engine.sampling.params import SamplingParams
from engine.scheduling.output import ScheduledSeq
from engine.spec_decode.rejection_sampler import num_accepted, verify

VOCAB = 6
EOS = 5
P0 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
P1 = torch.tensor([0.05, 0.10, 0.40, 0.20, 0.15, 0.10])
P2 = torch.tensor([0.50, 0.10, 0.10, 0.10, 0.10, 0.10])
MIN_P_VALUE = 1e-4      # chi-square p-value floor: fails one in ten thousand runs of a correct sampler


@dataclass(eq=False)
class _Req:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [0, 1])
    output_token_ids: list[int] = field(default_factory=list)
    request_id: str = "r"


def _verify(params: SamplingParams, drafts: tuple[int, ...], rows: torch.Tensor, outputs=(), sampler=None):
    """Verify `drafts` against target probabilities `rows` ([1 + len(drafts), VOCAB])."""
    request = _Req(params, output_token_ids=list(outputs))
    seq = ScheduledSeq("r", (0, *drafts), 10, (1,), 1 + len(drafts))
    return verify(sampler or Sampler([EOS]), rows.log(), [seq], [request])


def _counts(tokens: list[int]) -> np.ndarray:
    return np.bincount(np.asarray(tokens, dtype=np.int64), minlength=VOCAB)


def _pvalue(observed: np.ndarray, probs) -> float:
    """Chi-square goodness of fit of counts against probabilities (float64, summing to the count)."""
    probs = np.asarray(probs, dtype=np.float64)
    return chisquare(observed, probs / probs.sum() * observed.sum()).pvalue


def test_greedy_accepts_while_the_argmax_agrees():
    rows = torch.stack([P0, P1, P2])                     # argmax: 0, 2, 0
    greedy = SamplingParams(temperature=0.0)
    for drafts, want in [((0, 2), [0, 2, 0]), ((0, 1), [0, 2]), ((3, 2), [0]), ((0,), [0, 2])]:
        out = _verify(greedy, drafts, rows[:len(drafts) + 1])
        assert out.tokens["r"] == want and out.accepted["r"] == len(want) - 1
    assert num_accepted((1, 2, 3), (1, 2, 4, 9)) == 2


@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_tokens_follow_the_target_distribution(seeded):
    """4000 draws with drafts (1, 2): row 0's token ~ P0; given draft 1 accepted, row 1's ~ P1;
    acceptance ~ P0[1]; a rejection ~ P0 without token 1."""
    rows = torch.stack([P0, P1, P2])
    sampler = Sampler([EOS])
    firsts, seconds, rejected_firsts = [], [], []
    n = 4000
    for s in range(n):
        params = SamplingParams(temperature=1.0, seed=s if seeded else None)
        emitted = _verify(params, (1, 2), rows, sampler=sampler).tokens["r"]
        firsts.append(emitted[0])
        if emitted[0] == 1:
            seconds.append(emitted[1])
        else:
            rejected_firsts.append(emitted[0])
    assert _pvalue(_counts(firsts), P0) > MIN_P_VALUE
    assert _pvalue(_counts(seconds), P1) > MIN_P_VALUE
    residual = (P0 - torch.nn.functional.one_hot(torch.tensor(1), VOCAB)).clamp(min=0)   # max(p - q, 0)
    assert _counts(rejected_firsts)[1] == 0
    assert _pvalue(np.delete(_counts(rejected_firsts), 1), np.delete(residual.numpy(), 1)) > MIN_P_VALUE
    acceptance = len(seconds) / n                          # P(accept) = p(draft) = 0.25
    assert abs(acceptance - float(P0[1])) < 4 * (0.25 * 0.75 / n) ** 0.5


@pytest.mark.parametrize("knobs", [dict(), dict(top_k=3), dict(top_p=0.7), dict(min_p=0.3, temperature=0.7)])
def test_seeded_rows_draw_what_the_plain_sampler_draws_at_that_position(knobs):
    """Row i of a verification = the plain sampler on the request with the first i drafts as outputs."""
    rows = torch.stack([P0, P1, P2]).log()
    sampler = Sampler([EOS])
    drafts = (1, 2)
    for seed in range(200):
        params = SamplingParams(**{"temperature": 1.0, **knobs, "seed": seed})
        request = _Req(params, output_token_ids=[3, 4])
        seq = ScheduledSeq("r", (0, *drafts), 10, (1,), 3)
        got = verify(sampler, rows, [seq], [request]).tokens["r"]
        want = []
        for i in range(3):
            plain = _Req(params, output_token_ids=[3, 4, *drafts[:i]])
            want.append(sampler.sample(rows[i:i + 1], [plain]).token_ids[0])
            if i < 2 and want[-1] != drafts[i]:
                break
        assert got == want, seed


def test_penalties_and_min_tokens_see_the_drafts_before_each_row():
    rows = torch.stack([P0, P0, P0])
    sampler = Sampler([EOS])
    # frequency penalty 2 on tokens already output: after outputs [0] and draft 0, rows 1 and 2
    # must avoid 0 as well (the plain sampler at those positions would have seen it)
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    out = _verify(params, (0, 1), rows, outputs=[0], sampler=sampler)
    assert out.tokens["r"] == [1]                    # row 0 avoids 0 (already output): draft 0 rejected
    out = _verify(params, (1, 2), rows, outputs=[0], sampler=sampler)
    assert out.tokens["r"] == [1, 2, 3]              # each row penalises the drafts before it
    # min_tokens 3 with 1 output: rows 0 and 1 may not emit eos, row 2 may
    eos_rows = torch.tensor([[0.01, 0.01, 0.01, 0.01, 0.01, 0.95]] * 3)
    params = SamplingParams(temperature=0.0, min_tokens=3)
    out = _verify(params, (0, 0), eos_rows, outputs=[4], sampler=sampler)
    assert out.tokens["r"] == [0, 0, EOS]


def test_logprobs_are_each_rows_raw_logprobs():
    rows = torch.stack([P0, P1, P0])
    params = SamplingParams(temperature=0.0, logprobs=2)
    out = _verify(params, (0, 2), rows)
    assert out.tokens["r"] == [0, 2, 0]
    for lp, row, token in zip(out.logprobs["r"], rows, out.tokens["r"]):
        assert lp.logprob == pytest.approx(float(row.log()[token]), abs=1e-5)
        assert [t for t, _ in lp.top] == row.argsort(descending=True)[:2].tolist()


def test_a_step_mixes_plain_rows_and_verifications():
    rows = torch.stack([P1, P0, P1, P2, P0])         # plain(P1), verify 2 drafts (P0, P1, P2), plain(P0)
    greedy = SamplingParams(temperature=0.0)
    requests = [_Req(greedy, request_id=rid) for rid in "abc"]
    seqs = [ScheduledSeq("a", (5,), 4, (1,), True), ScheduledSeq("b", (5, 0, 1), 4, (2,), 3),
            ScheduledSeq("x", (7, 7, 7), 0, (3,), False), ScheduledSeq("c", (5,), 4, (4,), True)]
    out = verify(Sampler([EOS]), rows.log(), seqs, [requests[0], requests[1], _Req(greedy), requests[2]])
    assert out.tokens == {"a": 2, "b": [0, 2], "c": 0}
    assert out.accepted == {"b": 1} and out.drafts == {"b": (0, 1)}
