"""Workload mixes and open-loop arrival schedules for the goodput benchmark, reproducible from a seed.

Prompts are random lowercase letters and spaces. The built-in presets' tokenizer is byte-level (one
token per byte, plus bos), so a prompt of B bytes is exactly B + 1 prompt tokens and input lengths
are controlled; requests set `ignore_eos` and `max_tokens`, so output lengths are controlled too.

Arrivals are Poisson at the offered rate. A share of them (`burst_fraction`) instead arrives in
bursts of `burst_size` requests at one instant, the bursts themselves Poisson, so the mean offered
rate stays the nominal one while the queue sees spikes. A share of requests (`cancel_fraction`)
closes its stream after a few tokens, as a user who navigates away.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ALPHABET = "abcdefghijklmnopqrstuvwxyz     "   # ~1 space in 6: word-like, all single-byte


@dataclass(frozen=True)
class Mix:
    """One workload mix; ranges are inclusive and drawn uniformly."""

    name: str
    description: str
    prompt_bytes: tuple[int, int]            # the request's own text (after any shared prefix)
    output_tokens: tuple[int, int]
    num_prefixes: int = 0                    # > 0: every prompt starts with one of these shared prefixes
    prefix_bytes: int = 0
    prefix_caching: bool = False             # pods cache prefixes only where prompts share them
    cancel_fraction: float = 0.05
    cancel_after_tokens: tuple[int, int] = (2, 6)
    burst_fraction: float = 0.2
    burst_size: int = 6

    def __post_init__(self) -> None:
        for name in ("prompt_bytes", "output_tokens", "cancel_after_tokens"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{self.name}: {name} must be 0 <= low <= high, got {(low, high)}")
        if self.output_tokens[0] < 1:
            raise ValueError(f"{self.name}: output_tokens must be >= 1")
        if (self.num_prefixes > 0) != (self.prefix_bytes > 0):
            raise ValueError(f"{self.name}: num_prefixes and prefix_bytes go together")
        if not (0 <= self.cancel_fraction <= 1 and 0 <= self.burst_fraction <= 1) or self.burst_size < 1:
            raise ValueError(f"{self.name}: fractions must be in [0, 1] and burst_size >= 1")

    @property
    def max_total_tokens(self) -> int:
        """Longest prompt + output in tokens (bos included), to check against the model's length."""
        return 1 + self.prefix_bytes + self.prompt_bytes[1] + self.output_tokens[1]


# Shared prefixes are 1023 bytes, so bos + prefix fill exactly 64 blocks of 16: all of it is cacheable.
MIXES: dict[str, Mix] = {m.name: m for m in (
    Mix("chat", "short chat: 32-384 byte prompts, 32-160 tokens out",
        prompt_bytes=(32, 384), output_tokens=(32, 160)),
    Mix("long-prompt", "long prompts, short outputs: 1000-1800 byte prompts, 8-32 tokens out",
        prompt_bytes=(1000, 1800), output_tokens=(8, 32)),
    Mix("shared-prefix", "RAG / agent: one of 8 shared 1023-byte prefixes + 32-192 bytes, 16-64 tokens out",
        prompt_bytes=(32, 192), output_tokens=(16, 64), num_prefixes=8, prefix_bytes=1023, prefix_caching=True),
)}


@dataclass(frozen=True)
class RequestSpec:
    """One request of a run: when it is sent (seconds after the run starts) and what it asks."""

    index: int
    arrival_s: float
    prompt: str
    max_tokens: int
    cancel_after_tokens: int | None = None   # close the stream after this many streamed chunks


def random_text(rng: random.Random, num_bytes: int) -> str:
    return "".join(rng.choices(ALPHABET, k=num_bytes))


def arrival_times(rate: float, duration_s: float, rng: random.Random, burst_fraction: float = 0.0,
                  burst_size: int = 1) -> list[float]:
    """Sorted arrival instants in [0, duration_s): Poisson background plus Poisson bursts, mean `rate`/s."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be > 0, got {rate}, {duration_s}")
    times: list[float] = []
    streams = [(rate * (1.0 - burst_fraction), 1)]
    if burst_fraction > 0:
        streams.append((rate * burst_fraction / burst_size, burst_size))
    for event_rate, size in streams:
        t = 0.0
        while event_rate > 0:
            t += rng.expovariate(event_rate)
            if t >= duration_s:
                break
            times.extend([t] * size)
    return sorted(times)


def build_requests(mix: Mix, rate: float, duration_s: float, seed: int) -> list[RequestSpec]:
    """The run's requests; the same (mix, rate, duration, seed) always gives the same list, so
    every configuration of a comparison sees identical traffic."""
    rng = random.Random(f"{seed}:{mix.name}:{rate}:{duration_s}")
    prefixes = [random_text(random.Random(f"{seed}:{mix.name}:prefix:{i}"), mix.prefix_bytes)
                for i in range(mix.num_prefixes)]
    # Popular prefixes are reused more (Zipf-like weights), as hot documents or agent system prompts are.
    weights = [1.0 / (i + 1) for i in range(mix.num_prefixes)]
    requests = []
    for index, t in enumerate(arrival_times(rate, duration_s, rng, mix.burst_fraction, mix.burst_size)):
        prefix = rng.choices(prefixes, weights)[0] if prefixes else ""
        prompt = prefix + random_text(rng, rng.randint(*mix.prompt_bytes))
        max_tokens = rng.randint(*mix.output_tokens)
        cancel = rng.randint(*mix.cancel_after_tokens) if rng.random() < mix.cancel_fraction else None
        requests.append(RequestSpec(index, t, prompt, max_tokens, cancel))
    return requests
