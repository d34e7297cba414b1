"""The non-greedy draw: temperature-scaled logits -> top-k / top-p / min-p -> one token per row.

Every filter keeps an upper set of the row's values (top-k: `>= k-th value`; top-p: the shortest
head whose mass reaches `top_p`; min-p: `prob >= min_p * max prob`), so all three reduce to one
per-row threshold on the logit plus the min-p test `exp(l - max) >= min_p`. Thresholds come from
the row's values in descending order: the whole row sorted (numpy's vectorised sort on CPU: ~10x
torch's), or for rows with a small top-k a `torch.topk` slice (top-p and min-p act after top-k, so
a slice that holds every survivor, ties at the k-th value included, is exact).

No device reads. What to run is decided from the knobs on the host (`Knobs`), never by reading a
device tensor back, so a CUDA caller can queue the whole draw and read only the ids. The one size
that depends on the data is how many tokens tie with the k-th value. Off the CPU it is only ever
a tensor: the slice has a fixed width and the ties past its end, all equal to the k-th value, are
filled in from a count (`_sorted_survivors`); seeded draws cover the whole row. On CPU
(`host_memory`) a read is a load, not a round trip, so there the slice and the seeded draws are
sized by the data (`sample_sliced`), which is what keeps top-k rows cheap on CPU.

Probabilities are left unnormalised, `exp(l - max)`: each entry depends only on its own logit and
the row's max, so neither the batch nor the slice width can change them by a rounding.

Draws. Seeded rows use the exponential race, `argmax(p / E)`, `E ~ Exp(1)` from a generator seeded
with `derive_seed(seed, position)`: the m-th draw goes to the m-th top-k survivor in token-id order
(every token of the vocabulary when top-k is off), so the token depends on (seed, position, row)
only. Drawing more values than there are survivors changes nothing: torch's CPU and CUDA
exponential streams give element i the same value whatever the length drawn, so off the CPU a
seeded row draws the whole vocabulary and gives survivor m draw m by its rank. Unseeded rows with
a slice race too (a few dozen draws); other unseeded rows take one uniform through the CDF (exact,
and ~10x cheaper than 32000 exponential draws).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# A `torch.topk` slice beats sorting the whole row (numpy) up to roughly this k on CPU.
MAX_SLICE_TOP_K = 256
_CHUNK = 256   # tokens per first-stage chunk of the unseeded inverse-CDF draw


def host_memory(device: torch.device) -> bool:
    """Whether tensors on `device` live in host memory (CPU). Reading one back is then a load, not
    a device round trip: work may be sized by the data, and numpy's faster kernels used."""
    return device.type == "cpu"


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`. On CUDA from pinned memory without waiting: a plain copy from
    pageable memory would wait for everything queued before it."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def upload(device: torch.device, ints: Sequence[Sequence[int]] = (),
           floats: Sequence[Sequence[float]] = ()) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Host lists as device tensors (int64 and fp32; None for an empty list), in one copy
    (`to_device`). Everything goes up as fp32, exact for ints below 2**24 (row indices, top-k
    below the vocabulary size). In host memory there is no copy to save, and a tensor per list is
    cheaper than cutting one up."""
    if host_memory(device):
        return ([torch.tensor(column, dtype=torch.long) if column else None for column in ints],
                [torch.tensor(column, dtype=torch.float32) if column else None for column in floats])
    host = torch.tensor(list(itertools.chain.from_iterable(itertools.chain(ints, floats))), dtype=torch.float32)
    packed = to_device(host, device)
    num_ints = sum(len(column) for column in ints)
    as_ints = packed[:num_ints].long() if num_ints else None     # one cast for every int list
    return _columns(as_ints, ints), _columns(packed[num_ints:], floats)


def _columns(packed: torch.Tensor | None, columns: Sequence[Sequence[float]]) -> list[torch.Tensor | None]:
    """`packed` cut into views as long as `columns` (slicing: a few times cheaper than `split`)."""
    views, start = [], 0
    for column in columns:
        views.append(packed[start: start + len(column)] if column else None)
        start += len(column)
    return views


def seeded_first(seeds: Sequence[int | None]) -> list[int]:
    """Row indices, the seeded rows then the unseeded ones, when `seeds` has both; else []."""
    seeded = [j for j, s in enumerate(seeds) if s is not None]
    if not 0 < len(seeded) < len(seeds):
        return []
    return seeded + [j for j, s in enumerate(seeds) if s is None]


@dataclass(frozen=True)
class Knobs:
    """The filters and seeds of `n` rows: on the host to decide what runs, on the device to run it."""

    top_k: tuple[int, ...]              # 0: off (so is k >= vocab)
    top_p: tuple[float, ...]            # 1: off
    min_p: tuple[float, ...]            # 0: off
    seeds: tuple[int | None, ...]       # generator seeds (`engine.sampling.sampler.derive_seed`); None: unseeded
    device_top_k: torch.Tensor          # [n] int64
    device_top_p: torch.Tensor          # [n] fp32
    device_min_p: torch.Tensor          # [n] fp32
    device_order: torch.Tensor | None   # [n] int64 `seeded_first(seeds)`; None unless both kinds

    @classmethod
    def build(cls, top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float],
              seeds: Sequence[int | None], device: torch.device) -> Knobs:
        """Knobs with their device copies, made in one `upload`."""
        (device_top_k, order), (device_top_p, device_min_p) = upload(
            device, [top_k, seeded_first(seeds)], [top_p, min_p])
        return cls(tuple(top_k), tuple(top_p), tuple(min_p), tuple(seeds),
                   device_top_k, device_top_p, device_min_p, order)

    def subset(self, rows: Sequence[int], device: torch.device) -> Knobs:
        return Knobs.build([self.top_k[j] for j in rows], [self.top_p[j] for j in rows],
                           [self.min_p[j] for j in rows], [self.seeds[j] for j in rows], device)


def sort_descending(x: torch.Tensor) -> torch.Tensor:
    """Values of each row of `x` in descending order (indices are not needed here)."""
    if host_memory(x.device):
        return torch.from_numpy(np.sort(x.numpy(), axis=-1)[:, ::-1].copy())
    return x.sort(dim=-1, descending=True).values


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` (first maximum on ties); numpy on CPU, where torch's is ~5x slower."""
    if host_memory(x.device):   # the seam the no-sync tests take (a GPU's path on a CPU)
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


def sample_random(scaled: torch.Tensor, knobs: Knobs, generator: torch.Generator) -> torch.Tensor:
    """One token per row of temperature-scaled logits (`[n, vocab]`, may be overwritten). On CPU,
    rows with a small top-k work on their `topk` slice (`sample_sliced`); the others, and every
    row on other devices, on the whole row (`sample_full`)."""
    if not host_memory(scaled.device):
        return sample_full(scaled, knobs, generator)
    n = len(knobs.top_k)
    sliced = [j for j, k in enumerate(knobs.top_k) if 0 < k <= MAX_SLICE_TOP_K]
    if len(sliced) == n:
        return sample_sliced(scaled, knobs, generator)
    if not sliced:
        return sample_full(scaled, knobs, generator)
    tokens = torch.empty(n, dtype=torch.long)
    sliced_set = set(sliced)
    for group, sample in ((sliced, sample_sliced), ([j for j in range(n) if j not in sliced_set], sample_full)):
        rows = torch.tensor(group)
        tokens[rows] = sample(scaled[rows], knobs.subset(group, scaled.device), generator)
    return tokens


def sample_sliced(scaled: torch.Tensor, knobs: Knobs, generator: torch.Generator) -> torch.Tensor:
    """Tokens for rows whose `top_k` is between 1 and `MAX_SLICE_TOP_K` (`scaled`: `[n, vocab]`).

    CPU only (`host_memory`): the slice grows to hold every token tied with the k-th value, a size
    read from the data (numpy views of host memory, no device round trip)."""
    vocab = scaled.shape[1]
    top_k = knobs.device_top_k
    width = min(max(knobs.top_k) + 1, vocab)
    while True:
        values, ids = scaled.topk(width, dim=-1)                        # [n, w], descending
        kth = values.gather(1, (top_k - 1)[:, None])
        # A row tied with its k-th value up to the slice's end may hold more survivors outside.
        if width == vocab or not (values[:, -1:] >= kth).any().numpy():
            break
        width = min(int((scaled >= kth).sum(dim=-1).numpy().max()) + 1, vocab)
    threshold = nucleus_threshold(values, top_k, knobs.device_top_p)   # [n, 1]
    weights = (values - values[:, :1]).exp_()                          # [n, w], max = 1
    keep = (values >= threshold) & (weights >= knobs.device_min_p[:, None])
    noise = torch.empty_like(weights).exponential_()
    if any(seed is not None for seed in knobs.seeds):
        # Seeded rows draw one Exp(1) per top-k survivor in token-id order: sort the slice so the
        # survivors come first by id, fill, then scatter back to slice order.
        survivors = values >= kth
        id_order = torch.where(survivors, ids, ids + vocab).argsort(dim=-1)
        by_id = torch.ones_like(noise)
        exponential_noise(by_id, knobs.seeds, survivors.sum(dim=-1).numpy().tolist(), generator)
        seeded = torch.tensor([seed is not None for seed in knobs.seeds])[:, None]
        noise = torch.where(seeded, torch.empty_like(noise).scatter_(1, id_order, by_id), noise)
    race = weights.masked_fill_(~keep, 0.0).div_(noise.clamp_(min=1e-20))
    return ids.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)


def sample_full(scaled: torch.Tensor, knobs: Knobs, generator: torch.Generator) -> torch.Tensor:
    """Tokens for any rows, working on whole rows (`scaled`: `[n, vocab]`, overwritten when no row
    filters by top-k or top-p). The filters that are on cost one row sort, or a `topk` slice
    when every top-p row also has a small top-k (`_sorted_survivors`)."""
    n, vocab = scaled.shape
    top_k = knobs.device_top_k
    filtered = any(k > 0 for k in knobs.top_k) or any(p < 1.0 for p in knobs.top_p)
    row_max = scaled.amax(dim=-1, keepdim=True)                        # [n, 1]
    # The thresholds below compare logits, so `scaled` survives only when they are needed.
    weights = ((scaled - row_max) if filtered else scaled.sub_(row_max)).exp_()   # [n, vocab], max = 1
    kth = None
    if filtered:
        k_index = (top_k.clamp(min=1) - 1)[:, None]
        max_k = max(knobs.top_k)
        top_p_rows = [j for j, p in enumerate(knobs.top_p) if p < 1.0]
        if not top_p_rows and max_k <= MAX_SLICE_TOP_K:
            head = scaled.topk(max_k, dim=-1).values                   # [n, max_k]
            threshold = kth = torch.where(top_k[:, None] > 0, head.gather(1, k_index), float("-inf"))
        else:
            if max_k <= MAX_SLICE_TOP_K and all(knobs.top_k[j] > 0 for j in top_p_rows):
                sorted_desc = _sorted_survivors(scaled, top_k, max_k)
            else:
                sorted_desc = sort_descending(scaled)
            threshold = nucleus_threshold(sorted_desc, top_k, knobs.device_top_p)
            kth = torch.where(top_k[:, None] > 0, sorted_desc.gather(1, k_index), float("-inf"))
        weights.masked_fill_(scaled < threshold, 0.0)
    if any(m > 0.0 for m in knobs.min_p):
        weights.masked_fill_(weights < knobs.device_min_p[:, None], 0.0)

    seeded_rows = [j for j, seed in enumerate(knobs.seeds) if seed is not None]
    if not seeded_rows:
        return _inverse_cdf(weights)
    if len(seeded_rows) == n:
        noise = _seeded_noise(scaled, kth, knobs, seeded_rows, None, generator)
        return weights.div_(noise.clamp_(min=1e-20)).argmax(dim=-1)
    order = knobs.device_order                      # the seeded rows, then the others
    seeded_index, unseeded_index = order[: len(seeded_rows)], order[len(seeded_rows):]
    noise = _seeded_noise(scaled, kth, knobs, seeded_rows, seeded_index, generator)
    drawn = torch.cat([weights[seeded_index].div_(noise.clamp_(min=1e-20)).argmax(dim=-1),
                       _inverse_cdf(weights[unseeded_index])])
    return torch.empty(n, dtype=torch.long, device=scaled.device).index_copy_(0, order, drawn)


def _sorted_survivors(scaled: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """What `sort_descending(scaled)` holds up to each row's last top-k survivor, then -inf: a
    stand-in for it wherever only the survivors count (`nucleus_threshold`), from a `topk` slice.

    A slice of `max_k + 1` holds every survivor unless ties with the k-th value reach past its end;
    the sorted row continues with those ties, all equal to the k-th value, so a count of the
    survivors fills them in. Rows with `top_k <= 0` must not filter by top-p (their survivors would
    be the whole row)."""
    vocab = scaled.shape[1]
    width = min(max_k + 1, vocab)
    head = scaled.topk(width, dim=-1).values                                   # [n, w], descending
    kth = head.gather(1, (top_k.clamp(min=1) - 1)[:, None])                    # [n, 1]
    num_survivors = (scaled >= kth).sum(dim=-1, keepdim=True)                  # [n, 1]
    position = torch.arange(vocab, device=scaled.device)
    sorted_desc = torch.where(position < num_survivors, kth, float("-inf"))    # [n, vocab]
    sorted_desc[:, :width] = head
    return sorted_desc


def _seeded_noise(scaled: torch.Tensor, kth: torch.Tensor | None, knobs: Knobs, seeded_rows: list[int],
                  seeded_index: torch.Tensor | None, generator: torch.Generator) -> torch.Tensor:
    """`[len(seeded_rows), vocab]` race noise for the seeded rows (`seeded_index`: the same on the
    device, None when that is every row): the m-th draw of the row's seed at its m-th top-k
    survivor in token-id order (every token when top-k is off); other tokens have no weight left.

    On CPU a top-k row draws exactly as many values as it has survivors (read from the data: one
    Exp(1) costs ~20 ns there, the whole vocabulary ~0.7 ms). Elsewhere every row draws the whole
    vocabulary (one launch either way) and survivor m takes draw m through its rank."""
    vocab = scaled.shape[1]
    with_top_k = [knobs.top_k[row] > 0 for row in seeded_rows]
    if host_memory(scaled.device):
        noise = torch.ones(len(seeded_rows), vocab)
        for j, row in enumerate(seeded_rows):
            generator.manual_seed(knobs.seeds[row])
            if with_top_k[j]:
                positions = torch.from_numpy(np.flatnonzero((scaled[row] >= kth[row]).numpy()))
                noise[j, positions] = torch.empty(len(positions)).exponential_(generator=generator)
            else:
                noise[j].exponential_(generator=generator)
        return noise
    noise = torch.empty(len(seeded_rows), vocab, device=scaled.device)
    for j, row in enumerate(seeded_rows):
        generator.manual_seed(knobs.seeds[row])
        noise[j].exponential_(generator=generator)
    if any(with_top_k):
        # Rows without top-k have kth = -inf: every token survives and the rank is its id.
        if seeded_index is not None:
            scaled, kth = scaled[seeded_index], kth[seeded_index]
        rank = (scaled >= kth).cumsum(dim=-1).sub_(1).clamp_(min=0)   # [s, vocab] int64
        noise = noise.gather(1, rank)
    return noise


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
