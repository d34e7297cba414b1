"""Turn one step's logits into one token per sequence, honouring each request's `SamplingParams`.

Order (as vLLM): logprobs are taken from the raw logits first; then repetition/presence/frequency
penalties, the min_tokens mask, and for non-greedy rows temperature, top-k, top-p, min-p and a draw.
Every stage runs once over all the rows that need it, so the cost does not grow with the number of
distinct settings in the batch; an all-greedy batch is one argmax.

Seeded requests are deterministic per (seed, output position): the draw uses the exponential-race
trick, `argmax(probs / E)` with `E ~ Exp(1)` drawn over the whole vocabulary from a generator seeded
by a hash of (seed, position). Each row's noise depends on nothing else in the batch, so a request
gets the same token whether it runs alone, batched, reordered, or split across a prefill and a
decode pod (on the same kind of device: CPU and CUDA generators produce different streams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


class SamplingRequest(Protocol):
    """What the sampler reads from a request (`engine.request.Request` satisfies it)."""

    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the `logprobs` most likely tokens (id, logprob)."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class SamplerOutput:
    token_ids: list[int]                       # one per sequence, in the order of `requests`
    logprobs: list[TokenLogprobs | None]       # None where the request did not ask for logprobs


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def derive_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for (request seed, output position); stable across processes."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 1


class Sampler:
    """Samples one token per row of a `[num_seqs, vocab]` fp32 logits tensor."""

    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._generators: dict[torch.device, torch.Generator] = {}

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> SamplerOutput:
        """One token per request; `requests[i]` owns row `i` of `logits` (never modified)."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [num_seqs={len(requests)}, vocab], got {tuple(logits.shape)}")
        raw_logits = logits.float()  # [num_seqs, vocab]
        params = [r.sampling_params for r in requests]

        logits = self._apply_penalties(raw_logits, requests)
        logits = self._apply_min_tokens(logits, requests)

        greedy = [p.is_greedy for p in params]
        if all(greedy):
            token_ids = logits.argmax(dim=-1)  # [num_seqs]
        else:
            token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)
            greedy_rows = [i for i, g in enumerate(greedy) if g]
            random_rows = [i for i, g in enumerate(greedy) if not g]
            if greedy_rows:
                rows = torch.tensor(greedy_rows, device=logits.device)
                token_ids[rows] = logits[rows].argmax(dim=-1)
            rows = torch.tensor(random_rows, device=logits.device)
            token_ids[rows] = self._sample_random(
                logits[rows], [params[i] for i in random_rows],
                [len(requests[i].output_token_ids) for i in random_rows])

        return SamplerOutput(token_ids=token_ids.tolist(),
                             logprobs=_gather_logprobs(raw_logits, token_ids, params))

    # -- penalties ---------------------------------------------------------------------------------

    def _apply_penalties(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
        """Repetition penalty over prompt+output tokens (HF/vLLM), presence/frequency over output
        tokens (OpenAI: `logit -= frequency * count + presence * (count > 0)`)."""
        rows = [i for i, r in enumerate(requests) if _has_penalty(r.sampling_params)]
        if not rows:
            return logits
        device = logits.device
        vocab = logits.shape[1]
        row_index = torch.tensor(rows, device=device)
        sub = logits[row_index]  # [n, vocab] (a copy: advanced indexing)
        params = [requests[i].sampling_params for i in rows]
        output_counts = _token_counts([requests[i].output_token_ids for i in rows], vocab, device)  # [n, vocab]

        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
            prompt_counts = _token_counts([requests[i].prompt_token_ids for i in rows], vocab, device)
            seen = (prompt_counts > 0) | (output_counts > 0)
            penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
            sub = torch.where(seen, penalised, sub)

        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        sub = sub - frequency * output_counts - presence * (output_counts > 0).float()

        logits = logits.clone()
        logits[row_index] = sub
        return logits

    def _apply_min_tokens(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
        """Forbid eos (unless ignore_eos) and the stop tokens until `min_tokens` have been produced."""
        vocab = logits.shape[1]
        rows: list[int] = []
        cols: list[int] = []
        for i, r in enumerate(requests):
            p = r.sampling_params
            if len(r.output_token_ids) >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned.update(self.eos_token_ids)
            for token_id in sorted(banned):
                if token_id < vocab:
                    rows.append(i)
                    cols.append(token_id)
        if not rows:
            return logits
        logits = logits.clone()
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
        return logits

    # -- random sampling ---------------------------------------------------------------------------

    def _sample_random(self, logits: torch.Tensor, params: list[SamplingParams],
                       positions: list[int]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one exponential-race draw per row."""
        device = logits.device
        vocab = logits.shape[1]
        temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
        logits = logits / temperature  # [n, vocab]

        # Each mask runs only on the rows that use it: a full-vocab sort (top-p) costs ~10x a top-k.
        k_rows = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
        if k_rows:
            rows = torch.tensor(k_rows, device=device)
            logits[rows] = _apply_top_k(logits[rows], torch.tensor([params[j].top_k for j in k_rows], device=device))
        p_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if p_rows:
            rows = torch.tensor(p_rows, device=device)
            logits[rows] = _apply_top_p(logits[rows], torch.tensor([params[j].top_p for j in p_rows], device=device))
        if any(p.min_p > 0.0 for p in params):
            probs = logits.softmax(dim=-1)
            min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
            threshold = probs.amax(dim=-1, keepdim=True) * min_p
            logits = logits.masked_fill(probs < threshold, float("-inf"))

        probs = logits.softmax(dim=-1)  # [n, vocab]
        noise = torch.empty_like(probs)
        unseeded = [j for j, p in enumerate(params) if p.seed is None]
        if len(unseeded) == len(params):
            noise.exponential_()
        else:
            generator = self._generator(device)
            for j, (p, position) in enumerate(zip(params, positions)):
                if p.seed is not None:
                    generator.manual_seed(derive_seed(p.seed, position))
                    noise[j].exponential_(generator=generator)
            if unseeded:
                noise[torch.tensor(unseeded, device=device)] = torch.empty(
                    len(unseeded), vocab, device=device).exponential_()
        # Exp(1) can return exactly 0; a masked token (prob 0) over 0 would be NaN, which argmax picks.
        return (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        return generator


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _token_counts(token_lists: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """`[len(token_lists), vocab]` float counts; ids >= vocab are dropped (they land in a spare column)."""
    max_len = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), max_len), vocab, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        if len(tokens):
            padded[i, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.long).clamp_(max=vocab)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the `top_k[i]` largest logits of row `i` (and every token tied with the k-th).

    The k-th value comes from one `topk(max k)`; masking by value, not by position, keeps the result
    independent of which other rows (and so which max k) share the batch.
    """
    kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1)[:, None])  # [n, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drop the low tail whose total probability is at most `1 - top_p[i]`; the top token stays."""
    sorted_logits = logits.sort(dim=-1).values  # [n, vocab] ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    num_dropped = (cumulative <= (1.0 - top_p)[:, None]).sum(dim=-1).clamp_(max=logits.shape[1] - 1)
    threshold = sorted_logits.gather(1, num_dropped[:, None])  # [n, 1]: smallest kept logit
    return logits.masked_fill(logits < threshold, float("-inf"))


def _gather_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                     params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """Raw log-probabilities (before penalties and temperature, vLLM's default) for rows that ask."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    row_index = torch.tensor(rows, device=raw_logits.device)
    logprobs = raw_logits[row_index].log_softmax(dim=-1)  # [n, vocab]
    sampled = logprobs.gather(1, token_ids[row_index][:, None]).squeeze(1).tolist()
    max_top = min(max(params[i].logprobs for i in rows), logprobs.shape[1])
    top_ids: list[list[int]] = [[] for _ in rows]
    top_values: list[list[float]] = [[] for _ in rows]
    if max_top:
        values, ids = logprobs.topk(max_top, dim=-1)  # [n, max_top], most likely first
        top_values, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs
        result[i] = TokenLogprobs(logprob=sampled[j], top=tuple(zip(top_ids[j][:n], top_values[j][:n])))
    return result
