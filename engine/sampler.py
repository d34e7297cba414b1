"""Turn one step's logits into one token per sequence, honouring each request's `SamplingParams`.

Order (as vLLM): logprobs are taken from the raw logits first; then repetition/presence/frequency
penalties, the min_tokens mask, and for non-greedy rows temperature, top-k, top-p, min-p and a draw
(`engine.random_sampling`). Every stage runs once over all the rows that need it, so the cost does
not grow with the number of distinct settings in the batch; an all-greedy batch is one argmax.
Penalties touch only the (row, token) pairs that occur, never a whole `[rows, vocab]` pass.

Seeded requests are deterministic per (seed, output position): the draw uses the exponential-race
trick, `argmax(probs / E)` with `E ~ Exp(1)` from a generator seeded by a hash of (seed, position),
one draw per top-k survivor in token-id order (the whole vocabulary when top-k is off). Each row's
noise and probabilities depend on nothing else in the batch, so a request gets the same token
whether it runs alone, batched, reordered, or split across a prefill and a decode pod (on the same
kind of device: CPU and CUDA generators produce different streams).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from engine.random_sampling import MAX_SLICE_TOP_K, nucleus_threshold, row_argmax, sample_full, \
    sample_sliced, sort_descending
from engine.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams

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

        random_rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_TEMPERATURE_EPS]
        if not random_rows:
            token_ids = row_argmax(logits)  # [num_seqs]
        elif len(random_rows) == len(requests):
            # A penalised / masked copy is ours to scale in place (a full-size temporary less).
            token_ids = self._sample_random(logits, params, [len(r.output_token_ids) for r in requests],
                                            in_place=logits is not raw_logits)
        else:
            device = logits.device
            random_set = set(random_rows)
            greedy_rows = [i for i in range(len(requests)) if i not in random_set]
            token_ids = torch.empty(len(requests), dtype=torch.long, device=device)
            rows = torch.tensor(greedy_rows, device=device)
            token_ids[rows] = row_argmax(logits[rows]).to(device)
            rows = torch.tensor(random_rows, device=device)
            token_ids[rows] = self._sample_random(
                logits[rows], [params[i] for i in random_rows],
                [len(requests[i].output_token_ids) for i in random_rows], in_place=True)

        return SamplerOutput(token_ids=token_ids.tolist(),
                             logprobs=_gather_logprobs(raw_logits, token_ids, params))

    # -- penalties ---------------------------------------------------------------------------------

    def _apply_penalties(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
        """Repetition penalty over prompt+output tokens (HF/vLLM), presence/frequency over output
        tokens (OpenAI: `logit -= frequency * count + presence * (count > 0)`).

        Works on flat `row * vocab + token` keys of the tokens that occur, so the cost follows the
        number of tokens, not `rows x vocab`."""
        rows = [i for i, r in enumerate(requests) if _has_penalty(r.sampling_params)]
        if not rows:
            return logits
        device = logits.device
        vocab = logits.shape[1]
        params = [requests[i].sampling_params for i in rows]
        logits = logits.clone()
        flat = logits.view(-1)  # [num_seqs * vocab]
        output_keys = _token_keys([requests[i].output_token_ids for i in rows], rows, vocab)

        if any(p.repetition_penalty != 1.0 for p in params):
            prompt_keys = _token_keys([requests[i].prompt_token_ids for i in rows], rows, vocab)
            # Repeated keys read the same value and write the same result: no dedup needed.
            seen = torch.from_numpy(np.concatenate([prompt_keys, output_keys])).to(device)
            repetition = torch.ones(len(requests), device=device)
            repetition[rows] = torch.tensor([p.repetition_penalty for p in params], device=device)
            values, factor = flat[seen], repetition[seen // vocab]
            flat[seen] = torch.where(values > 0, values / factor, values * factor)

        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            keys, counts = _count_keys(output_keys)
            keys = torch.from_numpy(keys).to(device)
            frequency = torch.zeros(len(requests), device=device)
            presence = torch.zeros(len(requests), device=device)
            frequency[rows] = torch.tensor([p.frequency_penalty for p in params], device=device)
            presence[rows] = torch.tensor([p.presence_penalty for p in params], device=device)
            row_of = keys // vocab
            counts = torch.from_numpy(counts).to(device=device, dtype=flat.dtype)
            flat[keys] = flat[keys] - frequency[row_of] * counts - presence[row_of]
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
                       positions: list[int], in_place: bool = False) -> torch.Tensor:
        """Temperature, then top-k, top-p, min-p and one draw per row (`engine.random_sampling`).

        Rows with a small top-k work on their `topk` slice; the others on the whole row.
        `in_place`: `logits` is a private copy that may be overwritten."""
        device = logits.device
        vocab = logits.shape[1]
        temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
        scaled = logits.div_(temperature) if in_place else logits / temperature  # [n, vocab]
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        seeds = [None if p.seed is None else derive_seed(p.seed, position) for p, position in zip(params, positions)]
        generator = self._generator(device)
        sliced = [j for j, k in enumerate(top_k) if 0 < k <= MAX_SLICE_TOP_K]
        if len(sliced) == len(params):
            return sample_sliced(scaled, *self._knobs(params, top_k, range(len(params)), device), seeds, generator)
        if not sliced:
            return sample_full(scaled, *self._knobs(params, top_k, range(len(params)), device), seeds, generator)
        tokens = torch.empty(len(params), dtype=torch.long, device=device)
        sliced_set = set(sliced)
        for group, sample in ((sliced, sample_sliced),
                              ([j for j in range(len(params)) if j not in sliced_set], sample_full)):
            rows = torch.tensor(group, device=device)
            tokens[rows] = sample(scaled[rows], *self._knobs(params, top_k, group, device),
                                  [seeds[j] for j in group], generator)
        return tokens

    @staticmethod
    def _knobs(params: list[SamplingParams], top_k: list[int], rows: Sequence[int],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top_k, top_p, min_p) of `rows` as `[len(rows)]` tensors; top_k 0 means off."""
        return (torch.tensor([top_k[j] for j in rows], dtype=torch.long, device=device),
                torch.tensor([params[j].top_p for j in rows], dtype=torch.float32, device=device),
                torch.tensor([params[j].min_p for j in rows], dtype=torch.float32, device=device))

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        return generator


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _token_keys(token_lists: list[Sequence[int]], rows: list[int], vocab: int) -> np.ndarray:
    """Flat `row * vocab + token` keys (int64) of every token of `token_lists[j]` in row `rows[j]`;
    ids outside the vocabulary are dropped (a model may have more embeddings than logits)."""
    lengths = [len(tokens) for tokens in token_lists]
    tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=sum(lengths))
    keys = tokens + np.repeat(np.asarray(rows, dtype=np.int64) * vocab, lengths)
    return keys[(tokens >= 0) & (tokens < vocab)]


def _count_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys and how often each occurs (a sort: ~10x `np.unique`'s hashing for a few
    thousand keys)."""
    if not len(keys):   # no output yet: nothing to count
        return keys, np.zeros(0, dtype=np.int64)
    keys = np.sort(keys)
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    return keys[starts], np.diff(np.append(starts, len(keys)))


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the `top_k[i]` largest logits of row `i` (and every token tied with the k-th).

    The k-th value comes from one `topk(max k)`; masking by value, not by position, keeps the result
    independent of which other rows (and so which max k) share the batch.
    """
    kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1)[:, None])  # [n, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drop the low tail whose total probability is at most `1 - top_p[i]`; the top token stays.
    (The sampler applies the same `nucleus_threshold` without materialising masked logits.)"""
    threshold = nucleus_threshold(sort_descending(logits), torch.zeros_like(top_p, dtype=torch.long), top_p)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _gather_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                     params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """Raw log-probabilities (before penalties and temperature, vLLM's default) for rows that ask."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    if len(rows) == len(params):
        logprobs, sampled_ids = raw_logits.log_softmax(dim=-1), token_ids  # [n, vocab], [n]
    else:
        row_index = torch.tensor(rows, device=raw_logits.device)
        logprobs, sampled_ids = raw_logits[row_index].log_softmax(dim=-1), token_ids[row_index]
    sampled = logprobs.gather(1, sampled_ids[:, None]).squeeze(1).tolist()
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
