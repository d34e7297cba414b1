from __future__ import annotations

import pytest
import torch

from engine.sampling.random_sampling import Knobs, _sorted_survivors, nucleus_threshold, row_argmax, sample_full, \
    sample_sliced, sort_descending
from engine.request import Request
from engine.sampling.sampler import Sampler, _count_keys, _token_keys
from engine.sampling.params import SamplingParams

EOS = 5


def reference_kept(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The old full-vocab masks, written out: top-k by value, top-p on the ascending cumulative
    softmax, min-p against the max probability. `logits`: `[vocab]`; returns a bool `[vocab]`."""
    x = logits.clone()
    if top_k:
        x[x < x.topk(top_k).values[-1]] = float("-inf")
    if top_p < 1.0:
        ascending = x.sort().values
        num_dropped = int((ascending.softmax(-1).cumsum(-1) <= 1.0 - top_p).sum().clamp(max=len(x) - 1))
        x[x < ascending[num_dropped]] = float("-inf")
    if min_p:
        probs = x.softmax(-1)
        x[probs < probs.max() * min_p] = float("-inf")
    return x.isfinite()


def knobs(n, top_k=0, top_p=1.0, min_p=0.0, seeds=None):
    top_k, top_p, min_p = (x if isinstance(x, list) else [x] * n for x in (top_k, top_p, min_p))
    return Knobs.build(top_k, top_p, min_p, seeds or [None] * n, torch.device("cpu"))


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 0.9, 0.0), (40, 0.8, 0.0), (7, 1.0, 0.0),
                                                 (0, 1.0, 0.05), (100, 0.95, 0.01), (0, 0.5, 0.1)])
def test_filters_keep_the_same_tokens_as_the_full_vocab_masks(top_k, top_p, min_p):
    torch.manual_seed(3)
    logits = torch.randn(8, 1000) * 3
    draws = 300
    for path in (sample_full, sample_sliced) if top_k else (sample_full,):
        tokens = path(logits.repeat_interleave(draws, 0), knobs(8 * draws, top_k, top_p, min_p),
                      torch.Generator()).view(8, draws)
        support = [set(row) for row in tokens.tolist()]
        for row in range(8):
            kept = set(reference_kept(logits[row], top_k, top_p, min_p).nonzero().squeeze(1).tolist())
            assert support[row] <= kept, path.__name__
            # The likely kept tokens all show up in 300 draws.
            probs = logits[row].softmax(-1)
            assert {t for t in kept if probs[t] / probs[list(kept)].sum() > 0.05} <= support[row]


def test_nucleus_threshold_on_a_slice_equals_the_whole_row():
    torch.manual_seed(4)
    logits = torch.randn(6, 500)
    top_k = torch.tensor([3, 10, 50, 1, 20, 50])
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.3, 1.0, 0.7])
    whole = nucleus_threshold(sort_descending(logits), top_k, top_p)
    sliced = nucleus_threshold(logits.topk(51).values, top_k, top_p)
    assert torch.equal(whole, sliced)


@pytest.mark.parametrize("top_k", [[3, 10, 50, 1, 20, 50, 7, 2], [1, 1, 2, 3, 5, 8, 13, 21]])
def test_sorted_survivors_stand_in_for_the_sorted_rows(top_k):
    """Ties at the k-th value past the `topk` slice, and fewer finite values than k."""
    torch.manual_seed(8)
    logits = (torch.randn(8, 400) * 3).round()        # ~20 levels: ties everywhere
    logits[2, 5:] = float("-inf")
    logits[7] = -5.0
    logits[7, 0], logits[7, 100:200] = 2.0, 1.0      # the tail's mass decides top-p
    top_k = torch.tensor(top_k)
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.3, 1.0, 0.7, 0.95, 0.03])
    whole = nucleus_threshold(sort_descending(logits), top_k, top_p)
    assert torch.equal(nucleus_threshold(_sorted_survivors(logits, top_k, int(top_k.max())), top_k, top_p), whole)


def test_ties_at_the_kth_value_reach_past_the_slice():
    n = 400
    logits = torch.full((n, 300), -5.0)
    logits[:, 0], logits[:, 1] = 4.0, 3.0
    logits[:, 100:200] = 2.0      # 100 tokens tied for 3rd place: all survive top-k 3
    seeds = [seed if seed % 2 else None for seed in range(n)]
    tokens = sample_sliced(logits, knobs(n, top_k=3, seeds=seeds), torch.Generator())
    seen = set(tokens.tolist())
    assert seen <= {0, 1} | set(range(100, 200))
    assert len(seen & set(range(100, 200))) > 50


def test_seeded_rows_draw_the_same_token_on_either_path():
    torch.manual_seed(5)
    logits = torch.randn(16, 2000) * 2
    settings = knobs(16, [5, 40, 200, 1] * 4, 0.9, 0.02, seeds=[1000 + i for i in range(16)])
    full = sample_full(logits.clone(), settings, torch.Generator())
    sliced = sample_sliced(logits.clone(), settings, torch.Generator())
    assert full.tolist() == sliced.tolist()


def test_seeded_tokens_do_not_depend_on_which_path_the_batch_takes():
    torch.manual_seed(6)
    vocab = 3000
    logits = torch.randn(6, vocab) * 2
    settings = [dict(top_k=20), dict(top_k=300), dict(top_p=0.8), dict(), dict(top_k=20, min_p=0.1),
                dict(top_k=2999, top_p=0.9)]
    requests = [Request(f"r{i}", [1, 2], SamplingParams(seed=i, temperature=0.9, **kw))
                for i, kw in enumerate(settings)]
    alone = [Sampler([EOS]).sample(logits[i:i + 1], [requests[i]]).token_ids[0] for i in range(6)]
    assert Sampler([EOS]).sample(logits, requests).token_ids == alone
    assert Sampler([EOS]).sample(logits.flip(0), requests[::-1]).token_ids == alone[::-1]


def test_unseeded_full_rows_follow_the_masked_distribution():
    vocab = 300                    # not a multiple of the draw's chunk: the padding is never drawn
    probs = torch.zeros(vocab)
    probs[[3, 150, 260, 299]] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 4000
    logits = probs.log().expand(n, -1).clone()
    tokens = sample_full(logits, knobs(n), torch.Generator())
    freq = torch.bincount(tokens, minlength=vocab).float() / n
    assert set(tokens.tolist()) <= {3, 150, 260, 299}
    assert torch.allclose(freq, probs, atol=0.03)


def test_row_argmax_takes_the_first_maximum():
    x = torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0], [float("-inf"), 0.0, float("-inf")]])
    assert row_argmax(x).tolist() == [1, 0, 1]


def test_token_keys_drop_out_of_vocab_ids_and_count_repeats():
    keys = _token_keys([[1, 9, 1, 12], [], [0, 3]], [0, 1, 4], vocab=10)
    assert keys.tolist() == [1, 9, 1, 40, 43]
    distinct, counts = _count_keys(keys)
    assert distinct.tolist() == [1, 9, 40, 43] and counts.tolist() == [2, 1, 1, 1]
    distinct, counts = _count_keys(_token_keys([[], [12]], [0, 1], vocab=10))   # nothing generated yet
    assert distinct.tolist() == [] and counts.tolist() == []


def test_penalties_skip_tokens_outside_the_vocabulary_and_other_rows():
    logits = torch.ones(3, 4)
    requests = [Request("a", [0, 7], SamplingParams(repetition_penalty=2.0)),
                Request("b", [1], SamplingParams()),
                Request("c", [2], SamplingParams(frequency_penalty=1.0, presence_penalty=0.5))]
    for token in (3, 3, 9):
        requests[2].append_output_token(token)
    got = Sampler([EOS])._apply_penalties(logits, requests)
    assert got.tolist() == [[0.5, 1.0, 1.0, 1.0], [1.0] * 4, [1.0, 1.0, 1.0, 1.0 - 2.0 - 0.5]]
    assert torch.equal(logits, torch.ones(3, 4))


def test_degenerate_rows_draw_their_only_possible_token():
    one_token = torch.full((4, 8), float("-inf")).index_fill_(1, torch.tensor([3]), 0.0)
    settings = [dict(top_k=5), dict(top_p=0.9, seed=4), dict(top_k=5, seed=2), dict(min_p=0.5)]
    requests = [Request(f"r{i}", [1], SamplingParams(**kw)) for i, kw in enumerate(settings)]
    assert Sampler([EOS]).sample(one_token, requests).token_ids == [3] * 4
    single_vocab = torch.randn(2, 1)
    assert Sampler([EOS]).sample(single_vocab, requests[:2]).token_ids == [0, 0]


def test_sampling_never_writes_the_callers_logits():
    torch.manual_seed(7)
    logits = torch.randn(4, 50)
    before = logits.clone()
    settings = [dict(temperature=0.7, repetition_penalty=1.3), dict(temperature=0.0, presence_penalty=0.5),
                dict(top_p=0.8, min_tokens=2, max_tokens=4), dict(top_k=3, logprobs=2)]
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(**kw)) for i, kw in enumerate(settings)]
    for batch in (requests, requests[2:], requests[:1]):
        Sampler([EOS]).sample(logits[: len(batch)], batch)
        assert torch.equal(logits, before)


def _exponential_prefixes(device: str) -> list[bool]:
    """Whether n draws from a seed start with the same values as m < n draws: the whole-row
    seeded noise (off the CPU) relies on it to give the tokens the survivor-sized draws gave."""
    generator = torch.Generator(device=device)

    def draw(n):
        generator.manual_seed(1234)
        return torch.empty(n, device=device).exponential_(generator=generator)
    longest = draw(200_000)
    return [torch.equal(draw(n), longest[:n]) for n in (1, 3, 16, 41, 257, 4096, 32000, 128256)]


def test_cpu_exponential_draws_do_not_depend_on_how_many_are_drawn():
    assert all(_exponential_prefixes("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_exponential_draws_do_not_depend_on_how_many_are_drawn():
    assert all(_exponential_prefixes("cuda"))
