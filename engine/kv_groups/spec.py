"""Which layers share a block table, and where each layer's KV sits in a page.

A model whose layers all read the same span (every layer full, or every layer windowed) has one
group: a KV page holds every layer's KV for `block_size` tokens, exactly the single-group cache
(`[num_blocks, num_layers, 2, ...]`). A mixed model (Gemma 3's local and global layers, gpt-oss's
sliding and full ones) gets one group per `slots` layers of each window class, with the full
class first (group 0, whose table is `Request.block_ids`): a page holds `slots` layers' KV, and a
layer reads `kv[:, slot]` through its group's block table. Every group draws pages from the one
block pool, so the pages a local group frees behind its window serve any group's growth: the
memory a long chat's local layers no longer read goes to the global layers' KV (vLLM v1's hybrid
KV cache manager, `kv_cache_coordinator.py`, follows the same plan).

`slots` is the smallest window class's layer count, so that class fills its pages exactly; a
larger class that it does not divide leaves its last group's spare slots unused (Gemma 3 27B:
10 full and 52 local layers, 6 local groups of 10 slots, 8 slots of 70 idle).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import CacheConfig


@dataclass(frozen=True)
class KVGroups:
    """Group `g` holds the layers `layers[g]` (at slots 0, 1, ... of its pages) and reads a window
    of `windows[g]` tokens (0: full attention, only group 0 for a mixed model)."""

    windows: tuple[int, ...]
    layers: tuple[tuple[int, ...], ...]
    slots: int          # layers' KV per page (the cache's second dimension)

    def __post_init__(self) -> None:
        if len(self.windows) != len(self.layers) or not self.windows:
            raise ValueError(f"KVGroups needs a window per group, got {self.windows} for {len(self.layers)} groups")
        if any(len(group) > self.slots or not group for group in self.layers):
            raise ValueError(f"each group holds 1..{self.slots} layers, got {self.layers}")
        if list(self.windows) != sorted(self.windows):
            raise ValueError(f"full groups (window 0) come first, then windows in order, got {self.windows}")

    @classmethod
    def single(cls, num_layers: int, window: int = 0) -> KVGroups:
        """Every layer in one group: a page is the whole model's KV for a block."""
        return cls((window,), (tuple(range(num_layers)),), num_layers)

    @classmethod
    def for_windows(cls, layer_windows: tuple[int, ...], num_layers: int) -> KVGroups:
        """The groups of a model whose layer `i` has window `layer_windows[i]` (0: full; () when
        every layer is full): one group unless full and windowed layers mix."""
        windows = layer_windows or (0,) * num_layers
        classes: dict[int, list[int]] = {}
        for layer, window in enumerate(windows):
            classes.setdefault(window, []).append(layer)
        if len(classes) == 1 or 0 not in classes:
            return cls.single(num_layers, max(windows) if min(windows) > 0 else 0)
        slots = min(map(len, classes.values()))
        out_windows, out_layers = [], []
        for window in sorted(classes):          # the full class (0) first: group 0
            members = classes[window]
            for i in range(0, len(members), slots):
                out_windows.append(window)
                out_layers.append(tuple(members[i:i + slots]))
        return cls(tuple(out_windows), tuple(out_layers), slots)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_hybrid(self) -> bool:
        """Several groups (so a table per group); False for a single-group cache."""
        return len(self.windows) > 1

    @property
    def local_windows(self) -> tuple[int, ...]:
        """The windows of groups 1.. (the tables beside `Request.block_ids`)."""
        return self.windows[1:]

    def placement(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        """(group, slot) of each layer."""
        where = [(-1, -1)] * num_layers
        for group, members in enumerate(self.layers):
            for slot, layer in enumerate(members):
                where[layer] = (group, slot)
        if (-1, -1) in where:
            raise ValueError(f"groups {self.layers} leave a layer of {num_layers} without a place")
        return tuple(where)

    def describe(self) -> str:
        """One log line: `1 full group + 5 groups of window 512, 1 layer per page`."""
        if not self.is_hybrid:
            return f"one KV group ({self.slots} layers per page)"
        local = self.num_groups - self.windows.count(0)
        return (f"{self.windows.count(0)} full KV group(s) + {local} local group(s) of window(s) "
                f"{sorted(set(self.local_windows))}, {self.slots} layer(s) per page")


def serving_groups(layer_windows: tuple[int, ...], num_layers: int, role: str, speculative: bool,
                   mode: str = "auto") -> KVGroups:
    """The groups an engine runs: a mixed model's groups in every role (P/D pods move each
    group's pages from its window's start: `kvtransfer.kv_groups`), unless speculative decoding
    runs, whose draft model shares the target's block tables, or `mode` is "single"
    (`CacheConfig.kv_cache_groups`: a prefill pool pairing with speculating decode pods): then
    one group (every layer's KV for every block, as before). `role` does not change the groups."""
    groups = KVGroups.for_windows(layer_windows, num_layers)
    if groups.is_hybrid and (speculative or mode == "single"):
        return KVGroups.single(num_layers)
    return groups


def serving_cache(cache: CacheConfig, layer_windows: tuple[int, ...], num_layers: int, role: str,
                  speculative: bool) -> tuple[KVGroups, CacheConfig]:
    """The groups an engine runs (`serving_groups`, under `cache.kv_cache_groups`) and `cache` set for
    them, before sizing: `kv_group_windows` for a table per group, and `sliding_window` when every
    layer has a window (a single group's blocks behind it are freed). The engine builds its
    scheduler's KV cache manager from this, and so does the capacity planner's simulated pod
    (`cbserve.planner.sim_pod`), so both hold and free the same pages."""
    groups = serving_groups(layer_windows, num_layers, role, speculative, cache.kv_cache_groups)
    window = None if groups.is_hybrid else groups.windows[0] or None   # `ModelConfig.kv_free_window`
    return groups, dataclasses.replace(cache, kv_group_windows=groups.windows if groups.is_hybrid else (),
                                       sliding_window=window)


def num_pages(num_blocks: int, block_layers: int, groups: KVGroups) -> int:
    """Pages of `groups.slots` layers in the memory of `num_blocks` blocks of `block_layers` layers
    each (`--num-blocks` counts whole-model blocks: `block_layers` is the model's layer count)."""
    return num_blocks * block_layers // groups.slots


def cache_groups(layer_windows: tuple[int, ...], num_layers: int, kv_group_windows: tuple[int, ...]) -> KVGroups:
    """The groups of a cache configured with `CacheConfig.kv_group_windows` (() : one group)."""
    if not kv_group_windows:
        return KVGroups.single(num_layers)
    groups = KVGroups.for_windows(layer_windows, num_layers)
    if groups.windows != tuple(kv_group_windows):
        raise ValueError(f"kv_group_windows {tuple(kv_group_windows)} do not match the model's groups {groups.windows}")
    return groups
