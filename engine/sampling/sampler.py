"""Turn one step's logits into one token per sequence, honouring each request's `SamplingParams`.

Order (as vLLM): a structured-output mask first (`engine.grammar.mask`: rows with a grammar
only); logprobs are taken from the (masked) raw logits; then repetition/presence/frequency
penalties, the min_tokens mask, and for non-greedy rows temperature, top-k, top-p, min-p and a draw
(`engine.sampling.random_sampling`). Every stage runs once over all the rows that need it, so the cost does
not grow with the number of distinct settings in the batch; an all-greedy batch is one argmax.
Penalties touch only the (row, token) pairs that occur, never a whole `[rows, vocab]` pass.

Seeded requests are deterministic per (seed, output position): the draw uses the exponential-race
trick, `argmax(probs / E)` with `E ~ Exp(1)` from a generator seeded by a hash of (seed, position),
one draw per top-k survivor in token-id order (the whole vocabulary when top-k is off). Each row's
noise and probabilities depend on nothing else in the batch, so a request gets the same token
whether it runs alone, batched, reordered, or split across a prefill and a decode pod (on the same
kind of device: CPU and CUDA generators produce different streams).

Nothing is read back from the device while sampling: every decision comes from the requests'
`SamplingParams` on the host, and the per-row knobs go up in one copy. `sample_on_device` leaves
the ids on the device, where the next step can read them, with their copy to pinned host memory
already queued; `DeviceSample.resolve()` is the step's one device-to-host read. `sample` is both.
"""

from __future__ import annotations

import itertools
import operator
from typing import Protocol, Sequence

import numpy as np
import torch

from engine.sampling.random_sampling import Knobs, nucleus_threshold, row_argmax, sample_random, seeded_first, \
    sort_descending, to_device, upload
from engine.sampling.device_sample import DeviceSample, PinnedBuffers, SamplerOutput, TokenLogprobs, device_logprobs
from engine.grammar.mask import GrammarMask
from engine.runner.inference import inference_mode
from engine.sampling.params import GREEDY_TEMPERATURE_EPS, SamplingParams
from engine.sampling.screen import ScreenCache

_MASK64 = (1 << 64) - 1
_PARAMS = operator.attrgetter("sampling_params")


class SamplingRequest(Protocol):
    """What the sampler reads from a request (`engine.request.Request` satisfies it)."""

    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


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
        self._pinned = PinnedBuffers()
        self._screens = ScreenCache()

    def sample(self, logits: torch.Tensor, requests: Sequence[SamplingRequest],
               grammar: GrammarMask | None = None) -> SamplerOutput:
        """One token per request; `requests[i]` owns row `i` of `logits` (never modified).
        The same as `sample_on_device(logits, requests, grammar).resolve()`."""
        return self.sample_on_device(logits, requests, grammar).resolve()

    @inference_mode
    def sample_on_device(self, logits: torch.Tensor, requests: Sequence[SamplingRequest],
                         grammar: GrammarMask | None = None) -> DeviceSample:
        """`sample` without reading anything back: the ids stay on `logits.device` and the host
        moves on. Every decision comes from the requests' `SamplingParams` on the host, and the
        per-row knobs go up in one copy. On CUDA the ids (and logprobs) are already being copied
        into pinned memory when this returns; `DeviceSample.resolve()` waits for that copy only.
        `grammar`: structured-output masks of some rows, applied before every other step."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [num_seqs={len(requests)}, vocab], got {tuple(logits.shape)}")
        raw_logits = logits.float()  # [num_seqs, vocab]
        if grammar is not None:
            raw_logits = grammar.apply(raw_logits, copy=raw_logits is logits)
        # The batch's params screened (penalties? logprobs? random rows?), reused while the batch
        # stays (`engine.sampling.screen`): this runs for every request every step.
        params = list(map(_PARAMS, requests))
        screen = self._screens.screen(params)
        logits = self._apply_penalties(raw_logits, requests) if screen.penalized else raw_logits
        if screen.min_tokens:
            logits = self._apply_min_tokens(logits, requests, params,
                                            grammar.end_only_rows if grammar is not None else ())

        logprob_rows, random_rows = screen.logprob_rows, screen.random_rows
        # Logprobs of only some rows need those rows' indices on the device: they ride along.
        some_logprobs = logprob_rows if 0 < len(logprob_rows) < len(params) else []
        if random_rows:
            token_ids, device_logprob_rows = self._sample_random(
                logits, requests, random_rows, some_logprobs, in_place=logits is not raw_logits)
        else:
            token_ids = row_argmax(logits)  # [num_seqs]
            device_logprob_rows = upload(logits.device, [some_logprobs])[0][0] if some_logprobs else None

        logprobs = None
        if logprob_rows:
            logprobs = device_logprobs(raw_logits, token_ids, [params[i].logprobs for i in logprob_rows],
                                        logprob_rows, device_logprob_rows)
        return DeviceSample.start(token_ids, logprobs, self._pinned)

    # -- penalties ---------------------------------------------------------------------------------

    def _apply_penalties(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
        """Repetition penalty over prompt+output tokens (HF/vLLM), presence/frequency over output
        tokens (OpenAI: `logit -= frequency * count + presence * (count > 0)`). Only for a batch
        with a penalty (`BatchScreen.penalized`).

        Works on flat `row * vocab + token` keys of the tokens that occur, so the cost follows the
        number of tokens, not `rows x vocab`. The keys go up in one copy, the factors in another."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.penalized]
        if not rows:
            return logits
        device = logits.device
        vocab = logits.shape[1]
        params = [r.sampling_params for r in requests]
        logits = logits.clone(memory_format=torch.contiguous_format)
        flat = logits.view(-1)  # [num_seqs * vocab]
        output_keys = _token_keys([requests[i].output_token_ids for i in rows], rows, vocab)
        repetition = any(params[i].repetition_penalty != 1.0 for i in rows)
        additive = any(params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0 for i in rows)

        parts: list[np.ndarray] = []
        if repetition:
            # Repeated keys read the same value and write the same result: no dedup needed.
            prompt_keys = _token_keys([requests[i].prompt_token_ids for i in rows], rows, vocab)
            parts.append(np.concatenate([prompt_keys, output_keys]))
        if additive:
            parts.extend(_count_keys(output_keys))
        keys = to_device(torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts)), device)
        keys = keys.split([len(part) for part in parts])
        _, (repetition_factor, frequency, presence) = upload(device, floats=[
            [p.repetition_penalty for p in params] if repetition else [],
            [p.frequency_penalty for p in params] if additive else [],
            [p.presence_penalty for p in params] if additive else []])

        if repetition:
            seen = keys[0]
            values, factor = flat[seen], repetition_factor[seen // vocab]
            flat[seen] = torch.where(values > 0, values / factor, values * factor)
        if additive:
            counted, counts = keys[-2:]
            row_of = counted // vocab
            flat[counted] = flat[counted] - frequency[row_of] * counts.to(flat.dtype) - presence[row_of]
        return logits

    def _apply_min_tokens(self, logits: torch.Tensor, requests: Sequence[SamplingRequest],
                          params: list[SamplingParams], exempt_rows: frozenset[int] | tuple = ()) -> torch.Tensor:
        """Forbid eos (unless ignore_eos) and the stop tokens until `min_tokens` have been produced;
        not in `exempt_rows`, whose grammar allows nothing else (the grammar wins). Only for a
        batch with a minimum (`BatchScreen.min_tokens`)."""
        vocab = logits.shape[1]
        keys: list[int] = []    # row * vocab + token
        for i, r in enumerate(requests):
            p = r.sampling_params
            if len(r.output_token_ids) >= p.min_tokens or i in exempt_rows:
                continue
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned.update(self.eos_token_ids)
            keys.extend(i * vocab + token_id for token_id in sorted(banned) if token_id < vocab)
        if not keys:
            return logits
        logits = logits.clone(memory_format=torch.contiguous_format)
        logits.view(-1).index_fill_(0, to_device(torch.tensor(keys, dtype=torch.long), logits.device), float("-inf"))
        return logits

    # -- random sampling ---------------------------------------------------------------------------

    def _sample_random(self, logits: torch.Tensor, requests: Sequence[SamplingRequest], random_rows: list[int],
                       logprob_rows: list[int], in_place: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Ids for every row: argmax for greedy rows; for `random_rows` temperature, then top-k,
        top-p, min-p and one draw (`engine.sampling.random_sampling`). Also returns `logprob_rows` on the
        device (None when empty), sent in the same copy as the knobs. `in_place`: `logits` is a
        private copy that may be overwritten."""
        device = logits.device
        num_seqs, vocab = logits.shape
        mixed = len(random_rows) < num_seqs
        params = [requests[i].sampling_params for i in random_rows]
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        seeds = [None if p.seed is None else derive_seed(p.seed, len(requests[i].output_token_ids))
                 for i, p in zip(random_rows, params)]
        greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.temperature < GREEDY_TEMPERATURE_EPS]
        top_p, min_p = [p.top_p for p in params], [p.min_p for p in params]
        (rows, greedy_rows, device_top_k, order, device_logprob_rows), (temperature, device_top_p, device_min_p) = \
            upload(device, [random_rows if mixed else [], greedy_rows, top_k, seeded_first(seeds), logprob_rows],
                   [[p.temperature for p in params], top_p, min_p])
        knobs = Knobs(tuple(top_k), tuple(top_p), tuple(min_p), tuple(seeds), device_top_k, device_top_p,
                      device_min_p, order)
        generator = self._generator(device)
        if mixed:
            # The random rows' copy is ours to scale in place.
            scaled = logits[rows].div_(temperature[:, None])                              # [n, vocab]
            token_ids = torch.empty(num_seqs, dtype=torch.long, device=device)
            token_ids.index_copy_(0, greedy_rows, row_argmax(logits[greedy_rows]))
            token_ids.index_copy_(0, rows, sample_random(scaled, knobs, generator))
        else:
            # A penalised / masked copy is ours to scale in place (a full-size temporary less).
            scaled = logits.div_(temperature[:, None]) if in_place else logits / temperature[:, None]
            token_ids = sample_random(scaled, knobs, generator)
        return token_ids, device_logprob_rows

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        return generator


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

    Masking by value, not by position, keeps the result independent of which other rows share the
    batch. (A reference for the tests: the sampler finds the same k-th value without a mask.)
    """
    kth = sort_descending(logits).gather(1, (top_k - 1)[:, None])  # [n, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drop the low tail whose total probability is at most `1 - top_p[i]`; the top token stays.
    (The sampler applies the same `nucleus_threshold` without materialising masked logits.)"""
    threshold = nucleus_threshold(sort_descending(logits), torch.zeros_like(top_p, dtype=torch.long), top_p)
    return logits.masked_fill(logits < threshold, float("-inf"))
