"""The block tables of a hybrid cache's groups 1.. (group 0's is `Request.block_ids`).

Every group's table has one entry per `block_size` tokens of the request, so all tables of a
request have the same length and grow together (`KVCacheManager.allocate_slots`). A windowed
group's query at position p reads keys from `p - window + 1` on: once `n` tokens are computed,
no later query of that group reads an entry wholly before `n - window + 1`, so `free_behind`
returns those pages to the pool (their entries become the null block) each time the tables grow,
as the single-group cache does when every layer has a window. A full group (a mixed model whose
full layers fill more than one group) never frees early.

Prefix caching: a group's pages are cached under the request's block-hash chain salted per group
(`salted`), since the same tokens have one page per group. A cached prefix of k blocks is usable
only where group 0 holds blocks 0..k-1 and every windowed group holds the blocks the query at
k * block_size reads (`hit`); the others are null. Torch-free: the scheduler's simulation
(`cbserve.planner`) runs the same code.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_pool import NULL_BLOCK_ID, BlockPool

_MASK = (1 << 64) - 1
_SALT = 0xD6E8FEB86659FD93   # an odd 64-bit constant: group g's salt is g times it


def salted(block_hash: int, group: int) -> int:
    """The cache key of group `group`'s page holding the block whose chained hash is `block_hash`."""
    return block_hash ^ ((_SALT * group) & _MASK)


class GroupTables:
    """Per request, the tables of groups 1..len(windows) over one shared `BlockPool`."""

    def __init__(self, block_pool: BlockPool, block_size: int, windows: Sequence[int]) -> None:
        """`windows[i]`: group i + 1's window (0: full)."""
        self.block_pool = block_pool
        self.block_size = block_size
        self.windows = tuple(windows)
        self._ids: dict[str, list[list[int]]] = {}        # request id -> a table per group
        self._freed: dict[str, list[int]] = {}            # request id -> leading entries freed, per group
        self._pending: dict[str, list[list[int]]] = {}    # request id -> hits `hit` found, for `adopt`
        # request id -> a tuple per group, rebuilt when a table changes (the runner reads them).
        self.tables: dict[str, tuple[tuple[int, ...], ...]] = {}

    def first_in_window(self, window: int, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - window + 1) // self.block_size if window else 0

    def first_blocks_in_window(self, num_computed_tokens: int) -> tuple[int, ...]:
        """Per group 1.., the first table entry a query after `num_computed_tokens` tokens reads:
        where a P/D pull of a prompt of that length starts each group (both pods derive it from
        the windows the handshake compared)."""
        return tuple(self.first_in_window(w, num_computed_tokens) for w in self.windows)

    def num_to_reserve(self, num_blocks: int, num_tokens: int) -> int:
        """Pages `reserve` takes for a prompt of `num_tokens` tokens in `num_blocks` blocks."""
        return sum(num_blocks - first for first in self.first_blocks_in_window(num_tokens))

    def max_blocks_held(self, num_blocks: int, max_chunk: int) -> int:
        """The most pages these groups hold at once for a request of `num_blocks` blocks computed
        in chunks of at most `max_chunk` tokens (see `KVCacheManager.max_blocks_held`)."""
        bs = self.block_size
        return sum(min(num_blocks, (w + max_chunk - 2) // bs + 2) if w else num_blocks for w in self.windows)

    # ------------------------------------------------------------------ prefix lookup
    def hit(self, request_id: str, hashes: Sequence[int], found: Sequence[int]) -> int:
        """The longest usable prefix, in blocks, given group 0's cached run `found` (blocks
        0..len(found)-1): every group must hold what the query after it reads. Keeps each group's
        hits for `adopt` (null before its window)."""
        lookup, bs = self.block_pool.cached_blocks.get, self.block_size
        k = len(found)
        per_group = [[lookup(salted(h, g)) for h in hashes[:k]] for g in range(1, len(self.windows) + 1)]
        while k:
            firsts = [self.first_in_window(w, k * bs) for w in self.windows]
            if all(None not in pages[first:k] for pages, first in zip(per_group, firsts)):
                break
            k -= 1
        if k:
            self._pending[request_id] = [[NULL_BLOCK_ID] * first + pages[first:k]
                                         for pages, first in zip(per_group, firsts)]
        else:
            self._pending.pop(request_id, None)
        return k

    def num_evictable_hits(self, request_id: str) -> int:
        """Pages among the pending hits that sit in the free queue (referencing them takes them)."""
        ref_cnt = self.block_pool.ref_cnt
        return sum(1 for pages in self._pending.get(request_id, ()) for b in pages if b and ref_cnt[b] == 0)

    # ------------------------------------------------------------------ allocation
    def num_needed(self, request_id: str, length: int, with_hits: bool) -> int:
        """New pages to grow every group's table to `length` entries (after `free_behind`)."""
        tables = self._ids.get(request_id)
        if tables is None:
            held = [len(p) for p in self._pending[request_id]] if with_hits else [0] * len(self.windows)
        else:
            held = list(map(len, tables))
        return sum(max(0, length - n) for n in held)

    def free_behind(self, request_id: str, num_computed_tokens: int) -> None:
        """Free each windowed group's pages that no query from `num_computed_tokens` on reads."""
        tables = self._ids.get(request_id)
        if tables is None:
            return
        freed, changed = self._freed[request_id], False
        for g, window in enumerate(self.windows):
            first = self.first_in_window(window, num_computed_tokens)
            done = freed[g]
            if first > done:
                ids = tables[g]
                self.block_pool.free_blocks([b for b in ids[done:first] if b])
                ids[done:first] = [NULL_BLOCK_ID] * (first - done)
                freed[g], changed = first, True
        if changed:
            self.tables[request_id] = tuple(map(tuple, tables))

    def adopt(self, request_id: str, with_hits: bool) -> None:
        """Start a fresh request's tables: its pending hits (referenced now, before any page is
        taken from the free queue, which could evict them), or empty ones."""
        if request_id in self._ids:
            return
        hits = self._pending.pop(request_id) if with_hits else [[] for _ in self.windows]
        for pages in hits:
            self.block_pool.touch(b for b in pages if b)
        self._ids[request_id] = hits
        self._freed[request_id] = [sum(1 for b in pages if not b) for pages in hits]

    def reserve(self, request_id: str, num_blocks: int, num_tokens: int) -> None:
        """Decode role: tables of `num_blocks` entries for a prompt of `num_tokens` tokens whose
        KV a peer sends: a windowed group gets pages only from the entry its first decode query
        reads on (null before it, counted as freed, so never freed nor cached twice); the caller
        checked that `num_to_reserve` pages fit."""
        assert request_id not in self._ids, f"request {request_id} already holds group pages"
        pool, tables, freed = self.block_pool, [], []
        for first in self.first_blocks_in_window(num_tokens):
            tables.append([NULL_BLOCK_ID] * first + pool.get_new_blocks(num_blocks - first))
            freed.append(first)
        self._ids[request_id], self._freed[request_id] = tables, freed
        self.tables[request_id] = tuple(map(tuple, tables))

    def extend(self, request_id: str, length: int) -> None:
        """Grow every group's table to `length` entries with new pages (the caller checked that
        `num_needed` fit)."""
        tables, pool = self._ids[request_id], self.block_pool
        for ids in tables:
            if length > len(ids):
                ids.extend(pool.get_new_blocks(length - len(ids)))
        self.tables[request_id] = tuple(map(tuple, tables))

    def cache(self, request_id: str, hashes: Sequence[int], start: int, stop: int) -> None:
        """Register entries [start, stop) of every group's table (full, computed) in the cache."""
        tables = self._ids.get(request_id)
        if tables is None or not self.block_pool.enable_prefix_caching:
            return
        block_hash, cached = self.block_pool.block_hash, self.block_pool.cached_blocks
        for g, ids in enumerate(tables, start=1):
            for i in range(start, stop):
                page, key = ids[i], salted(hashes[i], g)
                if page and block_hash[page] is None and key not in cached:
                    cached[key] = page
                    block_hash[page] = key

    def free(self, request_id: str) -> None:
        """Release every page of the request's tables (tail first, as `KVCacheManager.free`)."""
        tables = self._ids.pop(request_id, None)
        if tables is not None:
            for ids in tables:
                self.block_pool.free_blocks([b for b in reversed(ids) if b])
        self._freed.pop(request_id, None)
        self._pending.pop(request_id, None)
        self.tables.pop(request_id, None)

    def pages(self, request_id: str) -> list[int]:
        """Every page the request's tables hold (nulls included): for invariant checks."""
        return [b for ids in self._ids.get(request_id, ()) for b in ids]

    def num_held(self, request_id: str) -> list[int]:
        """Pages (not null) each group's table holds."""
        return [sum(1 for b in ids if b) for ids in self._ids.get(request_id, ())]
