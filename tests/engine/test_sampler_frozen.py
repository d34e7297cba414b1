"""Seeded tokens pinned to the values the sampler drew before it became sync-free (cd48cc9).

The logits are exact multiples of simple fractions (no RNG, no transcendental functions), so the
cases are the same on every machine; the tokens then depend only on the sampler and on torch's
CPU exponential stream. Several cases tie at the k-th value (`tied`), some past a top-k slice, and
one has fewer finite logits than its top-k. A change here means a seeded request would draw other
tokens than it did before: that must be a deliberate decision, not a side effect.
"""

from __future__ import annotations

import pytest
import torch

from engine.sampling import random_sampling
from engine.request import Request
from engine.sampling.sampler import Sampler
from engine.sampling.params import SamplingParams

EOS = 5


def distinct(rows: int, vocab: int) -> torch.Tensor:
    """Every row a permutation of `vocab` evenly spaced values in [-6, 6) (no ties)."""
    j, r = torch.arange(vocab), torch.arange(rows)[:, None]
    return ((j * 7919 + r * 31337) % vocab).float() * (12.0 / vocab) - 6.0


def tied(rows: int, vocab: int) -> torch.Tensor:
    """61 levels, multiples of 1/8, each held by about `vocab / 61` tokens of the row."""
    j, r = torch.arange(vocab), torch.arange(rows)[:, None]
    return ((j * 7919 + r * 104729) % 61 - 30).float() / 8.0


def few_finite(rows: int, vocab: int, finite: int) -> torch.Tensor:
    """`finite` tokens per row with distinct values, the rest -inf."""
    logits = torch.full((rows, vocab), float("-inf"))
    for r in range(rows):
        ids = [(r * 37 + 11 * i) % vocab for i in range(finite)]
        logits[r, ids] = torch.arange(finite, dtype=torch.float32) / 4.0
    return logits


SETTINGS = [dict(top_k=20), dict(top_k=20, top_p=0.9, min_p=0.02), dict(top_p=0.8), dict(),
            dict(top_k=300, temperature=0.7), dict(min_p=0.1, temperature=1.3), dict(top_k=1),
            dict(top_k=5, top_p=0.5)]


def case(name: str) -> tuple[torch.Tensor, list[dict]]:
    """(logits, per-row params) of a named case; every row is seeded."""
    if name == "distinct":
        return distinct(len(SETTINGS), 1000), SETTINGS
    if name == "tied":
        return tied(len(SETTINGS), 500), SETTINGS
    if name == "tied_past_the_slice":       # top-k 3 and 40 over 61 levels of ~33 tokens each
        settings = [dict(top_k=3), dict(top_k=40, top_p=0.95), dict(top_k=3, min_p=0.5), dict(top_k=2)]
        return tied(len(settings), 2000), settings
    if name == "tied_at_256":               # the largest sliced top-k, tied past its slice
        settings = [dict(top_k=256), dict(top_k=256, top_p=0.9, temperature=0.5)]
        return tied(len(settings), 4000), settings
    if name == "tail_decides_top_p":        # the ties past the slice hold most of top-p's mass
        settings = [dict(top_k=2, top_p=0.03), dict(top_k=5, top_p=0.5, min_p=0.3), dict(top_k=2),
                    dict(top_k=3, top_p=0.05, temperature=0.6)]
        logits = torch.full((len(settings), 600), -5.0)
        for r in range(len(settings)):
            logits[r, 7 * r] = 2.0
            logits[r, 100 + r: 300 + r] = 1.0
        return logits, settings
    if name == "few_finite":                # top-k larger than the finite tokens: kth = -inf
        settings = [dict(top_k=5), dict(top_k=50, top_p=0.9), dict(top_k=400), dict(top_p=0.7)]
        return few_finite(len(settings), 300, 3), settings
    raise KeyError(name)


def run(name: str, position: int, sampler: Sampler | None = None) -> list[int]:
    logits, settings = case(name)
    requests = []
    for i, kw in enumerate(settings):
        request = Request(f"r{i}", [1, 2], SamplingParams(seed=1000 + 17 * i, **kw))
        for _ in range(position):
            request.append_output_token(7)
        requests.append(request)
    return (sampler or Sampler([EOS])).sample(logits, requests).token_ids


FROZEN: dict[tuple[str, int], list[int]] = {
    ('distinct', 0): [605, 498, 984, 457, 634, 282, 383, 202],
    ('distinct', 1): [321, 992, 194, 608, 29, 47, 383, 881],
    ('distinct', 5): [815, 350, 195, 151, 313, 775, 383, 560],
    ('tied', 0): [272, 199, 210, 459, 425, 490, 212, 239],
    ('tied', 1): [466, 382, 93, 192, 14, 47, 29, 300],
    ('tied', 5): [161, 482, 82, 270, 359, 314, 151, 483],
    ('tied_past_the_slice', 0): [782, 1591, 714, 1717],
    ('tied_past_the_slice', 1): [1575, 1591, 287, 1839],
    ('tied_past_the_slice', 5): [1880, 687, 1507, 1412],
    ('tied_at_256', 0): [1880, 2445],
    ('tied_at_256', 1): [2856, 798],
    ('tied_at_256', 5): [3161, 3177],
    ('tail_decides_top_p', 0): [222, 260, 286, 204],
    ('tail_decides_top_p', 1): [286, 152, 295, 270],
    ('tail_decides_top_p', 5): [295, 123, 183, 253],
    ('few_finite', 0): [22, 48, 74, 122],
    ('few_finite', 1): [22, 59, 96, 133],
    ('few_finite', 5): [0, 48, 74, 122],
}


@pytest.mark.parametrize("key", sorted(FROZEN))
def test_seeded_tokens_match_the_frozen_ones(key):
    assert run(*key) == FROZEN[key]


@pytest.mark.parametrize("key", sorted(FROZEN))
def test_the_device_formulation_draws_the_frozen_tokens_too(key, monkeypatch):
    """The formulation used off the CPU (no data-sized slice, whole-row noise) on CPU tensors."""
    monkeypatch.setattr(random_sampling, "host_memory", lambda device: False)
    assert run(*key) == FROZEN[key]


if __name__ == "__main__":      # regenerate: .venv/bin/python -m tests.engine.test_sampler_frozen
    for name in ("distinct", "tied", "tied_past_the_slice", "tied_at_256", "tail_decides_top_p", "few_finite"):
        for position in (0, 1, 5):
            print(f"    ({name!r}, {position}): {run(name, position)},")
