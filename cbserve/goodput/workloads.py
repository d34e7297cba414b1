"""Workload mixes and open-loop arrival schedules for the goodput benchmark, reproducible from a seed.

Prompts are random lowercase letters and spaces. The built-in presets' tokenizer is byte-level (one
token per byte, plus bos), so a prompt of B bytes is exactly B + 1 prompt tokens and input lengths
are controlled; requests set `ignore_eos` and `max_tokens`, so output lengths are controlled too.

Arrivals are a Poisson process conditioned on its count: exactly round(rate x duration) requests at
independent uniform instants (given its number of arrivals in a window, a Poisson process is exactly
that), so gaps are exponential but every run offers its nominal rate, and a short run is not
offered 30% less than its label by an unlucky draw. A share of the requests (`burst_fraction`)
arrives in bursts of `burst_size` at one instant, the bursts placed the same way. A share of requests (`cancel_fraction`)
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

    # The workload interface a trace (`cbserve.goodput.trace.Trace`) offers too.
    def requests(self, rate: float, duration_s: float, seed: int) -> list[RequestSpec]:
        return build_requests(self, rate, duration_s, seed)

    def warmup(self, seed: int, count: int) -> list[RequestSpec]:
        return warmup_requests(self, seed, count)


# Shared prefixes are 1023 bytes, so bos + prefix fill exactly 64 blocks of 16: all of it is cacheable.
MIXES: dict[str, Mix] = {m.name: m for m in (
    Mix("chat", "short chat: 32-384 byte prompts, 32-160 tokens out",
        prompt_bytes=(32, 384), output_tokens=(32, 160)),
    Mix("long-prompt", "long prompts, short outputs: 1000-1800 byte prompts, 8-32 tokens out",
        prompt_bytes=(1000, 1800), output_tokens=(8, 32)),
    # Agents and reasoning: little to prefill, many tokens to decode (stage B's decode-batch run, `cbserve profile`).
    Mix("long-output", "short prompts, long outputs: 32-128 byte prompts, 128-256 tokens out",
        prompt_bytes=(32, 128), output_tokens=(128, 256)),
    Mix("shared-prefix", "RAG / agent: one of 8 shared 1023-byte prefixes + 32-192 bytes, 16-64 tokens out",
        prompt_bytes=(32, 192), output_tokens=(16, 64), num_prefixes=8, prefix_bytes=1023, prefix_caching=True),
    # The yardstick for a CPU engine: random 256-token prompts, 64 tokens out, steady arrivals.
    Mix("fixed-256-64", "fixed shape: 255-byte prompts (256 tokens with bos), 64 tokens out, no bursts or cancels",
        prompt_bytes=(255, 255), output_tokens=(64, 64), cancel_fraction=0.0, burst_fraction=0.0),
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
    """Sorted arrival instants in [0, duration_s): round(rate x duration_s) of them, singles and bursts."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be > 0, got {rate}, {duration_s}")
    total = max(1, round(rate * duration_s))
    num_bursts = round(total * burst_fraction / burst_size)
    times = [rng.uniform(0.0, duration_s) for _ in range(total - num_bursts * burst_size)]
    for _ in range(num_bursts):
        times.extend([rng.uniform(0.0, duration_s)] * burst_size)
    return sorted(times)


def shared_prefixes(mix: Mix, seed: int) -> list[str]:
    """The mix's shared prefixes: the same for every rate of a seed, as a corpus of hot documents is."""
    return [random_text(random.Random(f"{seed}:{mix.name}:prefix:{i}"), mix.prefix_bytes)
            for i in range(mix.num_prefixes)]


def warmup_requests(mix: Mix, seed: int, count: int, max_tokens: int = 8) -> list[RequestSpec]:
    """At least `count` short requests, 0.5 s apart, that use every shared prefix once, so every rate
    of a sweep (the first included) meets a warm prefix cache and a router that has measured its pods."""
    rng = random.Random(f"{seed}:{mix.name}:warmup")
    prefixes = shared_prefixes(mix, seed)
    return [RequestSpec(i, 0.5 * i, (prefixes[i] if i < len(prefixes) else "")
                        + random_text(rng, rng.randint(*mix.prompt_bytes)), max_tokens)
            for i in range(max(count, len(prefixes)))]


def build_requests(mix: Mix, rate: float, duration_s: float, seed: int) -> list[RequestSpec]:
    """The run's requests; the same (mix, rate, duration, seed) always gives the same list, so
    every configuration of a comparison sees identical traffic."""
    rng = random.Random(f"{seed}:{mix.name}:{rate}:{duration_s}")
    prefixes = shared_prefixes(mix, seed)
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
