from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from engine.request import Request
from engine.sampling.sampler import Sampler, TokenLogprobs, _apply_top_k, _apply_top_p, derive_seed
from engine.sampling.params import SamplingParams

EOS = 5


def make_request(prompt=(1, 2), output=(), **params) -> Request:
    request = Request(request_id="r", prompt_token_ids=list(prompt), sampling_params=SamplingParams(**params))
    for token in output:
        request.append_output_token(token)
    return request


def support(sampler, logits_row, n, **params):
    """The set of tokens drawn over `n` independent unseeded rows."""
    logits = logits_row.expand(n, -1).clone()
    return set(sampler.sample(logits, [make_request(**params) for _ in range(n)]).token_ids)


def test_greedy_is_argmax_and_leaves_logits_untouched():
    logits = torch.randn(4, 11)
    before = logits.clone()
    out = Sampler([EOS]).sample(logits, [make_request(temperature=0.0) for _ in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4
    assert torch.equal(logits, before)


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
                           [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    penalised = make_request(prompt=(0, 4), output=(1, 2, 2), repetition_penalty=2.0,
                             presence_penalty=0.5, frequency_penalty=0.25)
    plain = make_request(prompt=(0, 4), output=(1, 2, 2))
    got = Sampler([EOS])._apply_penalties(logits, [penalised, plain])
    # token 0: in prompt, positive -> /2; token 4: in prompt, negative -> *2
    # token 1: output once, negative -> *2, then -0.25*1 - 0.5
    # token 2: output twice, positive -> /2, then -0.25*2 - 0.5; tokens 3, 5 untouched
    expected = [2.0 / 2, -1.0 * 2 - 0.25 - 0.5, 0.5 / 2 - 0.5 - 0.5, 3.0, -2.0 * 2, 1.0]
    assert got[0].tolist() == pytest.approx(expected)
    assert torch.equal(got[1], logits[1])


def test_top_k_keeps_ties_whatever_the_batch():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    alone = _apply_top_k(logits[:1], torch.tensor([2]))
    batched = _apply_top_k(logits, torch.tensor([2, 4]))
    assert torch.equal(alone, batched[:1])
    assert alone.isfinite().tolist() == [[True, True, True, True, False]]
    assert batched[1].isfinite().tolist() == [True, True, True, True, False]


def test_top_k_top_p_masks_exactly():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4)
    logits = probs.log()
    k = torch.tensor([2, 4, 4, 3])
    p = torch.tensor([1.0, 0.75, 0.85, 0.6])
    kept = _apply_top_p(_apply_top_k(logits, k), p).isfinite()
    assert kept.tolist() == [[True, True, False, False],   # top-k 2
                             [True, True, False, False],   # top-p .75: tail .05+.15 <= .25
                             [True, True, True, False],    # top-p .85: tail .05 <= .15
                             [True, True, False, False]]   # top-k 3, then top-p .6


@pytest.mark.parametrize("params, allowed", [
    (dict(top_k=2), {0, 1}),
    (dict(top_k=1), {0}),
    (dict(top_p=0.75), {0, 1}),
    (dict(min_p=0.2), {0, 1, 2}),          # threshold 0.2 * 0.5 = 0.1
    (dict(min_p=0.7), {0}),                # threshold 0.35
    (dict(top_k=-1), {0, 1, 2, 3}),
])
def test_sampling_knobs_restrict_support(params, allowed):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0]).log()
    assert support(Sampler([EOS]), logits, 400, **params) == allowed


def test_unseeded_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    tokens = Sampler([EOS]).sample(probs.log().expand(n, -1).clone(),
                                   [make_request() for _ in range(n)]).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([1.0, 0.0, -1.0, -2.0])
    n = 2000
    for temperature, expected in ((0.25, logits / 0.25), (3.0, logits / 3.0)):
        tokens = Sampler([EOS]).sample(logits.expand(n, -1).clone(),
                                       [make_request(temperature=temperature) for _ in range(n)]).token_ids
        freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
        assert torch.allclose(freq, expected.softmax(-1), atol=0.04)


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.zeros(3, 8)
    logits[:, EOS] = 10.0
    logits[:, 6] = 9.0
    logits[:, 2] = 8.0
    sampler = Sampler([EOS])
    requests = [
        make_request(output=(1,), temperature=0.0, min_tokens=2, stop_token_ids=(6,)),  # still short
        make_request(output=(1,), temperature=0.0, min_tokens=2, stop_token_ids=(6,), ignore_eos=True),
        make_request(output=(1, 1), temperature=0.0, min_tokens=2, stop_token_ids=(6,)),  # reached
    ]
    assert sampler.sample(logits, requests).token_ids == [2, EOS, EOS]


def test_seeded_sampling_is_independent_of_batch_composition_and_order():
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(6, vocab)
    requests = [make_request(output=(3,) * i, seed=100 + i, temperature=0.9, top_p=0.9, top_k=20)
                for i in range(6)]
    alone = [Sampler([EOS]).sample(logits[i:i + 1], [requests[i]]).token_ids[0] for i in range(6)]
    batched = Sampler([EOS]).sample(logits, requests).token_ids
    assert batched == alone

    order = [4, 0, 5, 2, 1, 3]
    mixed = [requests[i] for i in order] + [make_request(temperature=1.0), make_request(temperature=0.0)]
    mixed_logits = torch.cat([logits[order], torch.randn(2, vocab)])
    assert Sampler([EOS]).sample(mixed_logits, mixed).token_ids[:6] == [alone[i] for i in order]


def test_seed_and_position_both_matter():
    logits = torch.zeros(1, 1000)  # uniform: every draw is decided by the noise alone
    sampler = Sampler([EOS])
    by_position = [sampler.sample(logits, [make_request(output=(0,) * k, seed=7)]).token_ids[0] for k in range(8)]
    by_seed = [sampler.sample(logits, [make_request(seed=s)]).token_ids[0] for s in range(8)]
    assert len(set(by_position)) > 4 and len(set(by_seed)) > 4
    assert derive_seed(7, 3) == derive_seed(7, 3) != derive_seed(7, 4)
    assert 0 <= derive_seed(-(1 << 63), 0) < (1 << 63)


def test_seeded_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 3000
    tokens = Sampler([EOS]).sample(probs.log().expand(n, -1).clone(),
                                   [make_request(seed=s) for s in range(n)]).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_sampling_is_the_same_in_another_process():
    code = (
        "import torch; from engine.sampling.sampler import Sampler; from engine.request import Request;"
        "from engine.sampling.params import SamplingParams as P;"
        "g = torch.Generator().manual_seed(1); logits = torch.randn(3, 64, generator=g);"
        "reqs = [Request('r', [1], P(seed=s, temperature=0.8, min_p=0.01)) for s in (1, 2, 3)];"
        "print(Sampler([0]).sample(logits, reqs).token_ids)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 64, generator=g)
    reqs = [make_request(prompt=(1,), seed=s, temperature=0.8, min_p=0.01) for s in (3, 1, 2)]
    here = Sampler([0]).sample(logits[[2, 0, 1]], reqs).token_ids
    assert run.stdout.strip() == str([here[1], here[2], here[0]])


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    requests = [
        make_request(output=(1, 1), logprobs=3, temperature=0.5, repetition_penalty=1.3, frequency_penalty=1.0),
        make_request(logprobs=0, temperature=0.0),
        make_request(temperature=0.0),
        make_request(logprobs=20, seed=3),
    ]
    out = Sampler([EOS]).sample(logits, requests)
    reference = logits.log_softmax(-1)
    assert out.logprobs[2] is None
    for i, n in ((0, 3), (1, 0), (3, 20)):
        entry = out.logprobs[i]
        assert isinstance(entry, TokenLogprobs)
        assert entry.logprob == pytest.approx(reference[i, out.token_ids[i]].item(), abs=1e-6)
        values, ids = reference[i].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert math.isclose(sum(math.exp(v) for _, v in out.logprobs[3].top), reference[3].topk(20).values.exp().sum().item(),
                        rel_tol=1e-5)


def test_rejects_mismatched_logits():
    with pytest.raises(ValueError, match="num_seqs=2"):
        Sampler([EOS]).sample(torch.zeros(3, 4), [make_request(), make_request()])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_seeded_sampling_is_batch_invariant_and_greedy_matches_cpu():
    torch.manual_seed(2)
    logits = torch.randn(5, 32000)
    requests = [make_request(output=(1,) * i, seed=i, temperature=0.7, top_p=0.9, top_k=40, min_p=0.02,
                             repetition_penalty=1.2) for i in range(5)]
    sampler = Sampler([EOS])
    cuda_logits = logits.cuda()
    alone = [sampler.sample(cuda_logits[i:i + 1], [requests[i]]).token_ids[0] for i in range(5)]
    assert sampler.sample(cuda_logits, requests).token_ids == alone
    assert sampler.sample(cuda_logits.flip(0), requests[::-1]).token_ids == alone[::-1]
    greedy = [make_request(temperature=0.0, logprobs=2) for _ in range(5)]
    on_gpu, on_cpu = sampler.sample(cuda_logits, greedy), sampler.sample(logits, greedy)
    assert on_gpu.token_ids == on_cpu.token_ids
    assert on_gpu.logprobs[0].logprob == pytest.approx(on_cpu.logprobs[0].logprob, abs=1e-4)
