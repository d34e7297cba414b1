"""The non-greedy draw: temperature-scaled logits -> top-k / top-p / min-p -> one token per row.

Every filter keeps an upper set of the row's values (top-k: `>= k-th value`; top-p: the shortest
head whose mass reaches `top_p`; min-p: `prob >= min_p * max prob`), so all three reduce to one
per-row threshold on the logit plus the min-p test `exp(l - max) >= min_p`. Thresholds come from
the row's values in descending order: for rows with a small `top_k`, only the `torch.topk` slice
(top-p and min-p act after top-k, so the slice is exact, ties at the k-th value included); other
rows sort their whole row (numpy's vectorised sort on CPU: ~10x torch's).

Probabilities are left unnormalised, `exp(l - max)`: each entry depends only on its own logit and
the row's max, so neither the batch nor the slice width can change them by a rounding.

Draws. Seeded rows use the exponential race, `argmax(p / E)`, `E ~ Exp(1)` from a generator seeded
with `derive_seed(seed, position)`: one draw per top-k survivor in token-id order (every token of
the vocabulary when top-k is off), so the token depends on (seed, position, row) only. Unseeded
rows with a slice race too (a few dozen draws); unseeded full rows take one uniform through the
CDF (exact, and ~10x cheaper than 32000 exponential draws).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# A `torch.topk` slice beats sorting the whole row (numpy) up to roughly this k on CPU.
MAX_SLICE_TOP_K = 256
_CHUNK = 256   # tokens per first-stage chunk of the unseeded inverse-CDF draw


def sort_descending(x: torch.Tensor) -> torch.Tensor:
    """Values of each row of `x` in descending order (indices are not needed here)."""
    if x.device.type == "cpu":
        return torch.from_numpy(np.sort(x.numpy(), axis=-1)[:, ::-1].copy())
    return x.sort(dim=-1, descending=True).values


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` (first maximum on ties); numpy on CPU, where torch's is ~5x slower."""
    if x.device.type == "cpu":
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def nucleus_threshold(sorted_desc: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest logit each row keeps under top-k then top-p, `[n, 1]`.

    `sorted_desc` is `[n, w]`, each row's largest values in descending order, holding every
    top-k survivor (all ties with the k-th value) plus at least one more value when `w` is not the
    whole row. `top_k[i] <= 0` and `top_p[i] >= 1` mean off. Top-p drops the low tail of the
    survivors whose mass is at most `1 - top_p`: a token stays while the mass strictly above it is
    below `top_p` of the survivors' total (the first token always stays).
    """
    width = sorted_desc.shape[1]
    k_index = (top_k.clamp(min=1, max=width) - 1)[:, None]
    kth = torch.where(top_k[:, None] > 0, sorted_desc.gather(1, k_index), float("-inf"))  # [n, 1]
    weights = (sorted_desc - sorted_desc[:, :1]).exp_()
    weights.masked_fill_(sorted_desc < kth, 0.0)                      # [n, w], zero past top-k
    cumulative = weights.cumsum(dim=-1)                              # sequential per row
    above = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))      # mass strictly above each token
    num_kept = (above < top_p[:, None] * cumulative[:, -1:]).sum(dim=-1, keepdim=True).clamp_(min=1)
    top_p_threshold = sorted_desc.gather(1, num_kept - 1)
    return torch.where(top_p[:, None] < 1.0, torch.maximum(top_p_threshold, kth), kth)


def exponential_noise(noise: torch.Tensor, seeds: Sequence[int | None], lengths: Sequence[int],
                      generator: torch.Generator) -> None:
    """Refill row `j` of `noise` (`[n, w]`) with `lengths[j]` Exp(1) draws from `seeds[j]`, for the
    seeded rows; unseeded rows are left alone."""
    for j, seed in enumerate(seeds):
        if seed is not None:
            generator.manual_seed(seed)
            noise[j, : lengths[j]].exponential_(generator=generator)


def sample_sliced(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  seeds: Sequence[int | None], generator: torch.Generator) -> torch.Tensor:
    """Tokens for rows whose `top_k` is between 1 and `MAX_SLICE_TOP_K` (`scaled`: `[n, vocab]`)."""
    vocab = scaled.shape[1]
    width = min(int(top_k.max()) + 1, vocab)
    while True:
        values, ids = scaled.topk(width, dim=-1)                        # [n, w], descending
        kth = values.gather(1, (top_k - 1)[:, None])
        # A row tied with its k-th value up to the slice's end may hold more survivors outside.
        if width == vocab or not bool((values[:, -1:] >= kth).any()):
            break
        width = min(int((scaled >= kth).sum(dim=-1).max()) + 1, vocab)
    threshold = nucleus_threshold(values, top_k, top_p)                # [n, 1]
    weights = (values - values[:, :1]).exp_()                          # [n, w], max = 1
    keep = (values >= threshold) & (weights >= min_p[:, None])
    noise = torch.empty_like(weights).exponential_()
    if any(seed is not None for seed in seeds):
        # Seeded rows draw one Exp(1) per top-k survivor in token-id order: sort the slice so the
        # survivors come first by id, fill, then scatter back to slice order.
        survivors = values >= kth
        id_order = torch.where(survivors, ids, ids + vocab).argsort(dim=-1)
        by_id = torch.ones_like(noise)
        exponential_noise(by_id, seeds, survivors.sum(dim=-1).tolist(), generator)
        seeded = torch.tensor([seed is not None for seed in seeds], device=noise.device)[:, None]
        noise = torch.where(seeded, torch.empty_like(noise).scatter_(1, id_order, by_id), noise)
    race = weights.masked_fill_(~keep, 0.0).div_(noise.clamp_(min=1e-20))
    return ids.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)


def sample_full(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                seeds: Sequence[int | None], generator: torch.Generator) -> torch.Tensor:
    """Tokens for any rows (`scaled`: `[n, vocab]`, overwritten when no row filters by top-k or
    top-p); the filters that are on cost one row sort."""
    n, vocab = scaled.shape
    row_max = scaled.amax(dim=-1, keepdim=True)                        # [n, 1]
    filtered = bool(((top_k > 0) | (top_p < 1.0)).any())
    # The thresholds below compare logits, so `scaled` survives only when they are needed.
    weights = ((scaled - row_max) if filtered else scaled.sub_(row_max)).exp_()   # [n, vocab], max = 1
    kth = None
    if filtered:
        sorted_desc = sort_descending(scaled)
        threshold = nucleus_threshold(sorted_desc, top_k, top_p)
        weights.masked_fill_(scaled < threshold, 0.0)
        kth = torch.where(top_k[:, None] > 0,
                          sorted_desc.gather(1, (top_k.clamp(min=1) - 1)[:, None]), float("-inf"))
    if bool((min_p > 0.0).any()):
        weights.masked_fill_(weights < min_p[:, None], 0.0)

    tokens = torch.empty(n, dtype=torch.long, device=scaled.device)
    seeded_rows = [j for j, seed in enumerate(seeds) if seed is not None]
    unseeded_rows = [j for j, seed in enumerate(seeds) if seed is None]
    if seeded_rows:
        rows = torch.tensor(seeded_rows, device=scaled.device)
        sub = weights[rows]
        noise = torch.ones_like(sub)
        for j, row in enumerate(seeded_rows):
            generator.manual_seed(seeds[row])
            if int(top_k[row]) > 0:    # one draw per top-k survivor, in token-id order
                positions = (scaled[row] >= kth[row]).nonzero().squeeze(1)
                noise[j, positions] = torch.empty(len(positions), device=scaled.device).exponential_(
                    generator=generator)
            else:
                noise[j].exponential_(generator=generator)
        tokens[rows] = sub.div_(noise.clamp_(min=1e-20)).argmax(dim=-1)
    if unseeded_rows:
        sub = weights if len(unseeded_rows) == n else weights[torch.tensor(unseeded_rows, device=scaled.device)]
        tokens[torch.tensor(unseeded_rows, device=scaled.device)] = _inverse_cdf(sub)
    return tokens


def _inverse_cdf(weights: torch.Tensor) -> torch.Tensor:
    """One exact draw per row of unnormalised `weights` (`[n, vocab]`, each row with a positive max).

    Two stages, each an fp64 inverse CDF with its own uniform: a chunk of `_CHUNK` tokens by its
    total, then a token inside the chunk. fp64 keeps a small token's interval from being eaten by
    rounding, and only `vocab / _CHUNK` sums plus one chunk per row are ever widened to fp64
    (summing in fp64 directly runs ~20x slower on CPU)."""
    n, vocab = weights.shape
    pad = -vocab % _CHUNK
    if pad:
        weights = torch.nn.functional.pad(weights, (0, pad))             # zero weight: never drawn
    chunks = weights.view(n, -1, _CHUNK)                                  # [n, vocab / chunk, chunk]
    chunk = _draw(chunks.sum(dim=-1).double())   # [n]; fp32 chunk sums: relative error ~1e-7
    inside = chunks[torch.arange(n, device=weights.device), chunk]        # [n, chunk]
    return chunk * _CHUNK + _draw(inside.double())


def _draw(weights: torch.Tensor) -> torch.Tensor:
    """Index of the first cumulative weight above `u * total` per row (`weights`: `[n, m]` fp64);
    a zero weight has an empty interval and is never drawn."""
    cumulative = weights.cumsum(dim=-1)
    total = cumulative[:, -1:]                                            # [n, 1]
    target = torch.rand(total.shape, dtype=torch.float64, device=weights.device) * total
    target = torch.minimum(target, total.nextafter(torch.zeros_like(total)))   # strictly below total
    return torch.searchsorted(cumulative, target, right=True).squeeze(1)
