"""Pure-torch batched LoRA (reference and CPU path): shrink and expand over tokens grouped by adapter.

A step mixes tokens of several adapters (and of none). Every adapter lives in a device *slot*:
``a [S, R, K]`` (each slot's A matrices, parts stacked along R) and ``b [S, N, r]`` (its B rows,
the LoRA scaling folded in). Each token names its slot (``slot_ids [T]``, -1: no adapter), and

* shrink: ``h[t] = a[slot[t]] @ x[t]``        (``[T, K] -> [T, R]``)
* expand: ``y[t, cols_i] += b[slot[t], cols_i] @ h[t, i*r:(i+1)*r]`` for each slice ``i``

where a fused projection (q/k/v, gate/up) has one slice per part: its output columns are cut at
``slice_starts`` and slice ``i`` reads its own ``r`` columns of ``h``. Tokens without an adapter
are left alone (their rows of ``h`` are unspecified, ``y`` is not touched).

The plan (``LoRAPlan``) is built once per step and reused by every layer, as the Punica/S-LoRA
segmented kernels (SGMV) and vLLM's ``LoRAKernelMeta`` do. Here it is a ``Grouping``, read on the
host once: the tokens of each slot that occurs get consecutive *positions*, slot by slot, and
each projection runs

* one slot holding every token (one adapter for the whole batch): plain matmuls on all rows;
* otherwise, when each slot's run can be padded to one common width without doubling the rows
  (decode steps: a few tokens per adapter), one batched matmul over all those slots for the
  shrink and one per slice for the expand (``bmm`` over ``[slots, width, K]``), whatever the
  number of adapters: a per-adapter loop of small matmuls costs its dispatch per adapter, per
  projection, per layer, which on a CPU outweighs the LoRA arithmetic itself;
* otherwise (a long prefill chunk of one adapter beside a few decode tokens of others) one matmul
  pair per slot over its packed run, so the padding never multiplies a chunk's work.

Tokens are gathered into positions (``index_select``) and the expand's products gathered back to
token order, then added to ``y``: gathers, never a scatter-add into ``y``'s column slices (which
runs element by element on the CPU). Tokens without an adapter read one position whose products
are zeroed, so ``y`` gets exact zeros there. The Triton path (``lora_triton``) groups the same
rows on the device, padded to whole blocks (``moe_align``), without any host read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Grouping(NamedTuple):
    """The reference's token grouping (see the module docstring); built by ``lora_plan_ref``."""

    slots: tuple[int, ...]            # the slots that occur, ascending
    index: torch.Tensor | None        # [S_p] int64 of `slots` when they are not one contiguous range
    rows: torch.Tensor | None         # [P] int64: the token at each position; None: position = token
    positions: torch.Tensor | None    # [T] int64: each token's position (`rows`' inverse)
    width: int                        # > 0: every slot has `width` positions (batched); 0: packed runs
    runs: tuple[tuple[int, int], ...]  # (first position, length) of each slot's tokens
    zero: int                         # a position whose products are zeroed (tokens without an adapter); -1: none


class LoRAPlan(NamedTuple):
    """One step's token grouping by adapter slot, for ``lora_shrink`` / ``lora_expand``."""

    slot_ids: torch.Tensor      # [T] int32, -1: no adapter
    num_slots: int
    groups: Grouping | None = None      # the reference's (host-built)
    # Triton: sorted token rows [max_padded], each block's slot [max_padded // block_m] (num_slots:
    # no adapter), the padded length used [1] (``moe_align.moe_align_block_size``).
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    block_m: int = 0


def lora_plan_ref(slot_ids: torch.Tensor, num_slots: int) -> LoRAPlan:
    """Group the tokens of a step by slot (one host read of the step's slot ids)."""
    ids = slot_ids.tolist()
    members: dict[int, list[int]] = {}
    for token, slot in enumerate(ids):
        if slot >= 0:
            members.setdefault(slot, []).append(token)
    slots = tuple(sorted(members))
    counts = [len(members[s]) for s in slots]
    with_adapter = sum(counts)
    without = len(ids) - with_adapter
    if not slots:
        return LoRAPlan(slot_ids, num_slots, Grouping((), None, None, None, 0, (), -1))
    width = max(counts)
    if len(slots) * width > 2 * with_adapter:       # packed runs: padding would double the work
        width = 0
    elif without and len(slots) * width == with_adapter:
        width += 1                                  # room for the zeroed position
    rows: list[int] = []
    runs = []
    for slot in slots:
        runs.append((len(rows), len(members[slot])))
        rows += members[slot]
        if width:                                   # pad the run with its first token (never read back)
            rows += members[slot][:1] * (width - len(members[slot]))
    zero = -1
    if without and width:
        zero = next(start + count for start, count in runs if count < width)
    elif without:
        zero = len(rows)
        rows.append(0)
    positions = [zero] * len(ids)
    for slot, (start, _) in zip(slots, runs):
        for i, token in enumerate(members[slot]):
            positions[token] = start + i
    contiguous = slots == tuple(range(slots[0], slots[-1] + 1))
    in_order = rows == list(range(len(ids)))
    groups = Grouping(slots, None if contiguous else torch.tensor(slots, dtype=torch.int64),
                      None if in_order else torch.tensor(rows, dtype=torch.int64),
                      None if in_order else torch.tensor(positions, dtype=torch.int64), width, tuple(runs), zero)
    return LoRAPlan(slot_ids, num_slots, groups)


def _slots_of(w: torch.Tensor, g: Grouping) -> torch.Tensor:
    """`w [S, ...]` restricted to the step's slots: a view when they are one contiguous range."""
    return w.narrow(0, g.slots[0], len(g.slots)) if g.index is None else w.index_select(0, g.index)


def _grouped(t: torch.Tensor, g: Grouping) -> torch.Tensor:
    """Token rows -> position rows."""
    return t if g.rows is None else t.index_select(0, g.rows)


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, plan: LoRAPlan) -> torch.Tensor:
    """``x [T, K]``, ``a [S, R, K]`` -> ``h [T, R]`` in x's dtype (see the module docstring)."""
    g = plan.groups
    if not g.slots:
        return x.new_empty((x.shape[0], a.shape[1]))
    xg = _grouped(x, g)                                                       # [P, K]
    if len(g.slots) == 1:
        hg = torch.mm(xg, a[g.slots[0]].t())                                  # [P, R]
    elif g.width:
        hg = torch.bmm(xg.view(len(g.slots), g.width, -1), _slots_of(a, g).transpose(1, 2)).view(-1, a.shape[1])
    else:
        hg = x.new_empty((xg.shape[0], a.shape[1]))
        for slot, (start, count) in zip(g.slots, g.runs):
            torch.mm(xg[start:start + count], a[slot].t(), out=hg[start:start + count])
    return hg if g.positions is None else hg.index_select(0, g.positions)


def _expand_slice(part: torch.Tensor, b: torch.Tensor, g: Grouping, out: torch.Tensor | None = None) -> torch.Tensor:
    """One slice's ``part [P, r] @ b[slot, cols].T`` at every position: added into `out [P, N_i]`,
    or (out None) a new tensor."""
    cols = b.shape[1]
    if len(g.slots) == 1:
        weights = b[g.slots[0]].t()                                           # [r, N_i]
        return torch.mm(part, weights) if out is None else out.addmm_(part, weights)
    if g.width:
        stacked = part.view(len(g.slots), g.width, -1)                        # [S_p, width, r]
        weights = _slots_of(b, g).transpose(1, 2)                             # [S_p, r, N_i]
        if out is None:
            return torch.bmm(stacked, weights).view(-1, cols)
        out.view(len(g.slots), g.width, cols).baddbmm_(stacked, weights)
        return out
    if out is None:
        out = part.new_zeros((part.shape[0], cols))
    for slot, (start, count) in zip(g.slots, g.runs):
        out[start:start + count].addmm_(part[start:start + count], b[slot].t())
    return out


def lora_expand_ref(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, plan: LoRAPlan,
                    slice_starts: tuple[int, ...]) -> None:
    """``y [T, N] += `` each token's ``b [S, N, r]`` times its ``h [T, len(slice_starts) * r]``, in place."""
    g = plan.groups
    if not g.slots:
        return
    rank, num_cols = b.shape[2], b.shape[1]
    bounds = (*slice_starts, num_cols)
    hg = _grouped(h, g)                                                       # [P, slices * r]
    for i in range(len(slice_starts)):
        lo, hi = bounds[i], bounds[i + 1]
        part, weights = hg[:, i * rank:(i + 1) * rank], b[:, lo:hi]           # [P, r], [S, N_i, r]
        if g.positions is None:                # positions are the tokens (no padding, none without adapter)
            _expand_slice(part, weights, g, out=y[:, lo:hi])
            continue
        d = _expand_slice(part, weights, g)                                   # [P, N_i]
        if g.zero >= 0:
            d[g.zero].zero_()
        y[:, lo:hi].add_(d.index_select(0, g.positions))
