"""Workload mixes and arrival schedules: reproducible, at the offered rate, with controlled lengths."""

from __future__ import annotations

import random
import statistics

import pytest

from cbserve.goodput.workloads import MIXES, Mix, arrival_times, build_requests, shared_prefixes, warmup_requests
from engine.tokenizer import Tokenizer, build_byte_level_tokenizer


def test_same_seed_same_requests_other_seed_other_requests():
    mix = MIXES["chat"]
    first, again = build_requests(mix, 2.0, 30.0, seed=7), build_requests(mix, 2.0, 30.0, seed=7)
    assert first == again
    assert build_requests(mix, 2.0, 30.0, seed=8) != first
    assert [r.index for r in first] == list(range(len(first)))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(first, first[1:]))


def test_exact_count_and_exponential_gaps():
    rng = random.Random(0)
    times = arrival_times(5.0, 2000.0, rng)
    assert len(times) == 10_000          # exactly the offered rate
    gaps = [b - a for a, b in zip(times, times[1:])]
    # Exponential gaps: mean == standard deviation == 1 / rate.
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.1)
    assert all(0 <= t < 2000.0 for t in times)


def test_bursts_keep_the_mean_rate_and_arrive_together():
    times = arrival_times(4.0, 2000.0, random.Random(1), burst_fraction=0.5, burst_size=5)
    assert len(times) == 8000
    counts: dict[float, int] = {}
    for t in times:
        counts[t] = counts.get(t, 0) + 1
    in_bursts = sum(c for c in counts.values() if c == 5)
    assert in_bursts == 4000


@pytest.mark.parametrize("name", list(MIXES))
def test_lengths_stay_in_the_mix_bounds(name, tmp_path):
    mix = MIXES[name]
    tokenizer = Tokenizer.from_pretrained(build_byte_level_tokenizer(tmp_path))
    requests = build_requests(mix, 4.0, 50.0, seed=0)
    assert len(requests) > 100
    for r in requests[:40]:
        own = len(r.prompt) - mix.prefix_bytes
        assert mix.prompt_bytes[0] <= own <= mix.prompt_bytes[1]
        assert len(tokenizer.encode(r.prompt)) == len(r.prompt.encode()) + 1   # byte-level: 1 token/byte + bos
        assert mix.output_tokens[0] <= r.max_tokens <= mix.output_tokens[1]
    cancelled = [r for r in requests if r.cancel_after_tokens is not None]
    if mix.cancel_fraction:
        assert 0 < len(cancelled) < (mix.cancel_fraction + 0.1) * len(requests)
    else:
        assert not cancelled
    assert all(r.cancel_after_tokens < r.max_tokens for r in cancelled)
    assert mix.max_total_tokens <= 2048      # fits the tiny preset's context


def test_shared_prefix_mix_repeats_a_few_block_aligned_prefixes():
    mix = MIXES["shared-prefix"]
    requests = build_requests(mix, 4.0, 50.0, seed=0)
    prefixes = {r.prompt[:mix.prefix_bytes] for r in requests}
    assert len(prefixes) <= mix.num_prefixes
    assert (mix.prefix_bytes + 1) % 16 == 0        # bos + prefix = whole 16-token blocks
    # The same prefixes for every rate, so the cache sees the same documents across the sweep.
    assert prefixes == {r.prompt[:mix.prefix_bytes] for r in build_requests(mix, 1.0, 50.0, seed=0)}


def test_mix_validation():
    with pytest.raises(ValueError, match="output_tokens"):
        Mix("x", "", prompt_bytes=(1, 2), output_tokens=(0, 2))
    with pytest.raises(ValueError, match="go together"):
        Mix("x", "", prompt_bytes=(1, 2), output_tokens=(1, 2), num_prefixes=2)
    with pytest.raises(ValueError, match="rate"):
        arrival_times(0.0, 10.0, random.Random(0))


def test_warmup_touches_every_shared_prefix_and_no_measured_prompt():
    mix = MIXES["shared-prefix"]
    warm = warmup_requests(mix, seed=0, count=4)
    assert len(warm) == mix.num_prefixes
    assert {w.prompt[:mix.prefix_bytes] for w in warm} == set(shared_prefixes(mix, 0))
    measured = {r.prompt for r in build_requests(mix, 2.0, 30.0, seed=0)}
    assert not measured & {w.prompt for w in warm}
    assert len(warmup_requests(MIXES["chat"], seed=0, count=4)) == 4
