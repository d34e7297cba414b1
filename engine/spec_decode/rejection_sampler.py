"""Verification: which drafts a target forward accepts, and the token after them.

A request verified with drafts `d_1..d_k` has `k + 1` logits rows from one target forward: row `i`
is the target's distribution for output position `m + i` (`m` = tokens it has), given the drafts
before it. Every row is *sampled exactly as the non-speculative sampler would sample that
position* — the same penalties (over the outputs plus the drafts before the row), min_tokens mask,
temperature, top-k/p, min-p, and for seeded requests the same `(seed, m + i)` noise — by handing
`engine.sampling.sampler.Sampler` one `DraftRow` per row. Drafts are accepted while they equal the sampled
token; the first sampled token that differs (or the one after the last draft: the bonus) ends
the run. So the emitted tokens are, token for token, what the plain sampler emits one step at a
time (greedy: the argmax; seeded: the same draws), and the output distribution is the target's
exactly — speculation only decides how many positions one forward computes.

For point-mass drafts (every proposer here: n-gram lookups and the draft model's greedy tokens)
this *is* the rejection sampler of Leviathan et al. / vLLM's `rejection_sampler.py`: draft `d` is
accepted with probability `p(d) = min(1, p(d) / q(d))` for `q = one_hot(d)`, and a rejection emits
a token from `p` with `d` removed and renormalised, `norm(max(p - q, 0))` — the sample from `p`
conditioned on differing from `d`. (With a non-degenerate draft distribution `q` the two differ:
coupling by sampling accepts `sum_x p(x) q(x)` instead of `sum_x min(p(x), q(x))`; drafts here are
never sampled from `q`.) Logprobs are each row's raw logprobs, as without speculation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.grammar.mask import GrammarMask
from engine.sampling.sampler import Sampler, TokenLogprobs


class _Extended(Sequence):
    """`base + extra[:n]` without copying `base` (a request's outputs, read by the sampler)."""

    __slots__ = ("base", "extra", "n")

    def __init__(self, base: Sequence[int], extra: Sequence[int], n: int) -> None:
        self.base, self.extra, self.n = base, extra, n

    def __len__(self) -> int:
        return len(self.base) + self.n

    def __getitem__(self, i):
        return list(self)[i]

    def __iter__(self):
        yield from self.base
        yield from self.extra[:self.n]


@dataclass(frozen=True, slots=True)
class DraftRow:
    """What the sampler reads for verification row `i`: the request, as if `drafts[:i]` were accepted.
    `request_id` is None: requests with a grammar get no drafts, so no grammar mask is looked up
    for a draft row (`engine.grammar.structured_outputs.StructuredOutputs.prepare`)."""

    sampling_params: object
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    request_id: None = None


def draft_rows(request, drafts: Sequence[int]) -> list[DraftRow]:
    """The `len(drafts) + 1` sampler rows of one verification."""
    params, prompt, outputs = request.sampling_params, request.prompt_token_ids, request.output_token_ids
    return [DraftRow(params, prompt, _Extended(outputs, drafts, i)) for i in range(len(drafts) + 1)]


def num_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many drafts the sampled tokens confirm (`sampled` has one more row than `drafts`)."""
    accepted = 0
    for draft, token in zip(drafts, sampled):
        if draft != token:
            break
        accepted += 1
    return accepted


@dataclass
class Verified:
    """One step's verification. `tokens[id]`: a plain row's token (int) or a verified request's
    emitted tokens (list: the accepted drafts, then the token after them); `logprobs[id]`: one per
    emitted token; `accepted[id]`: accepted drafts of each verified request, `drafts[id]` its drafts."""

    tokens: dict[str, int | list[int]]
    logprobs: dict[str, list[TokenLogprobs | None]]
    accepted: dict[str, int]
    drafts: dict[str, tuple[int, ...]]


def verify(sampler: Sampler, logits: torch.Tensor, seqs, requests,
           grammar: Callable[[list], GrammarMask | None] | None = None) -> Verified:
    """Sample every row of a step whose seqs may carry drafts and accept the drafts.

    `seqs` are the step's `ScheduledSeq`s with the drafts in place (`token_ids[1:]` of a seq whose
    `sample` is `1 + k`), `requests[i]` owns `seqs[i]`; `logits` has one row per sampled token, in
    order (`engine.step_inputs`). `grammar(rows)`: the structured-output masks of the sampler's
    rows (the plain rows of requests with a grammar; the engine's `StructuredOutputs.prepare`)."""
    rows, owners = [], []          # owners: (request id, drafts or None, first row)
    for seq, request in zip(seqs, requests):
        sample = seq[4]
        if not sample:
            continue
        if sample == 1:                       # (True == 1)
            owners.append((seq[0], None, len(rows)))
            rows.append(request)
        else:
            drafts = seq[1][1:]
            owners.append((seq[0], drafts, len(rows)))
            rows += draft_rows(request, drafts)
    result = sampler.sample(logits, rows, None if grammar is None else grammar(rows))
    sampled, logprobs = result.token_ids, result.logprobs
    out = Verified({}, {}, {}, {})
    for request_id, drafts, first in owners:
        if drafts is None:
            out.tokens[request_id] = sampled[first]
            out.logprobs[request_id] = [logprobs[first]]
            continue
        accepted = num_accepted(drafts, sampled[first:first + len(drafts)])
        out.tokens[request_id] = sampled[first:first + accepted + 1]
        out.logprobs[request_id] = logprobs[first:first + accepted + 1]
        out.accepted[request_id] = accepted
        out.drafts[request_id] = drafts
    return out
