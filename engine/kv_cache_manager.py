"""Maps requests onto the block pool: prefix lookup, growing block tables, caching, freeing.

The manager owns no request state beyond per-request caches keyed by request id — the hash chain
of the request's full blocks (computed incrementally, so caching costs O(new blocks)), how many of
its blocks are already registered in the prefix cache, and an immutable copy of its block table. A
request's block table is `request.block_ids`, which only this manager changes; block `i` holds the
KV of `token_ids[i * block_size:(i + 1) * block_size]`.

Sliding windows (`sliding_window`: set only when EVERY layer of the model has one, since a block
holds all layers' KV): a query at position p reads keys from `p - window + 1` on, so once a
request has computed `n` tokens no later query reads a block wholly before `n - window + 1`.
`allocate_slots` frees those blocks first (each time the table grows, before the capacity check:
a decode frees one block per block it adds) and leaves the null block in their table entries, so
positions keep their meaning and the kernels never read there. A freed block keeps its prefix-cache
entry until the pool reuses it, and a prefix hit needs only the blocks the next query's window
covers (null before them): never a block whose content was replaced, since reusing a block evicts
its entry first. Every role frees: a prefill pod's chunked prefill of a long prompt holds about a
window of KV, and a P/D pull moves (and the decode pod `reserve`s) only the blocks from
`first_block_in_window(num_prompt_tokens)` on, those its first decode query reads, with null
entries before them (both pods derive that index from the same window and block size, which the
KV layout handshake compares). Nothing behind that index is freed before the pull ends, since a
prefill pod frees only behind its own earlier positions.

KV cache groups (`group_windows`, a mixed local/global model served colocated:
`engine.kv_groups`): `request.block_ids` is group 0's table (the full layers: nothing freed
early) and `groups` keeps the other groups' tables, which grow with it and free behind their
windows; every capacity test counts every group's pages, and a prefix hit is what every group
still holds (`GroupTables.hit`).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_pool import NULL_BLOCK_ID, ROOT_BLOCK_HASH, BlockPool, hash_block_tokens
from engine.kv_groups.tables import GroupTables
from engine.request import Request


class KVCacheManager:
    """vLLM-style KV cache manager over one `BlockPool`."""

    def __init__(self, block_pool: BlockPool, block_size: int, sliding_window: int | None = None,
                 group_windows: Sequence[int] = ()) -> None:
        """`sliding_window`: every layer's window (the widest one), when all layers have one: the
        blocks behind it are freed; None keeps every block until the request ends.
        `group_windows`: the windows of KV groups 1.. (0: full) beside group 0, whose table is
        `request.block_ids` and reads every block; () for a single-group cache."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if group_windows and sliding_window is not None:
            raise ValueError("KV groups beside a full group 0 exclude a sliding_window for every layer")
        self.groups = GroupTables(block_pool, block_size, group_windows) if group_windows else None
        # Pages one more block of a request costs: one per group (capacity tests multiply by it).
        self.num_groups = 1 + len(group_windows)
        self.block_pool = block_pool
        self.block_size = block_size
        self.sliding_window = sliding_window
        self._num_freed: dict[str, int] = {}   # request id -> leading table entries freed (window)
        self.enable_prefix_caching = block_pool.enable_prefix_caching
        self._block_hashes: dict[str, list[int]] = {}   # request id -> chained hashes of its full blocks
        self._num_cached_blocks: dict[str, int] = {}    # request id -> blocks registered in the cache
        # request id -> tuple(request.block_ids), rebuilt whenever the table changes, so every
        # request holding blocks has one: the scheduler hands every running request's table to the
        # runner each step, and a table changes only once per block_size decode steps.
        self.block_tables: dict[str, tuple[int, ...]] = {}
        # Prefix-cache statistics: one query per admission that allocated (see allocate_slots).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ------------------------------------------------------------------ stats
    @property
    def hit_ratio(self) -> float:
        """Prompt tokens served from the prefix cache / tokens looked up, 0 before any lookup."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def first_block_in_window(self, num_computed_tokens: int) -> int:
        """The first block that a query after `num_computed_tokens` tokens can read: those before
        it are wholly behind every layer's window (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def pull_starts(self, num_tokens: int) -> tuple[int, tuple[int, ...]]:
        """Where a P/D pull of a prompt of `num_tokens` tokens starts: the table index of group 0
        (`first_block_in_window`) and of each of groups 1.. (`GroupTables.first_blocks_in_window`;
        empty without KV groups). Both pods take it from here, from the windows the handshake
        compared, so they agree on every index."""
        groups = self.groups
        return (self.first_block_in_window(num_tokens),
                groups.first_blocks_in_window(num_tokens) if groups is not None else ())

    def group_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The request's tables of groups 1.. (empty without KV groups, or before it has any)."""
        groups = self.groups
        return groups.tables.get(request_id, ()) if groups is not None else ()

    def num_blocks_to_reserve(self, num_tokens: int) -> int:
        """Decode role: the blocks `reserve` takes for a prompt of `num_tokens` tokens (with KV
        groups, every group's pages)."""
        num_blocks = self.num_blocks_for(num_tokens)
        if self.groups is not None:
            return num_blocks + self.groups.num_to_reserve(num_blocks, num_tokens)
        return num_blocks - self.first_block_in_window(num_tokens)

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once, computed in chunks of at
        most `max_chunk` tokens: all of them, or with a window the blocks that the window behind a
        chunk and the chunk itself can span (`window - 1 + chunk` positions)."""
        num_blocks = self.num_blocks_for(num_tokens)
        if self.groups is not None:
            return num_blocks + self.groups.max_blocks_held(num_blocks, max_chunk)
        if self.sliding_window is None:
            return num_blocks
        return min(num_blocks, (self.sliding_window + max_chunk - 2) // self.block_size + 2)

    # ------------------------------------------------------------------ prefix lookup
    def _hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """The request's block-hash chain, extended to at least `num_full_blocks` blocks."""
        hashes = self._block_hashes.get(request.request_id)
        if hashes is None:
            hashes = self._block_hashes[request.request_id] = []
        if len(hashes) < num_full_blocks:
            bs, tokens, chain = self.block_size, request.token_ids, hash_block_tokens
            # An adapter's requests chain from its own root: KV computed under it is its own.
            parent = hashes[-1] if hashes else (ROOT_BLOCK_HASH if request.lora is None else request.lora.root_hash)
            for i in range(len(hashes), num_full_blocks):
                parent = chain(parent, tokens[i * bs:(i + 1) * bs])
                hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request: (block ids, number of tokens they cover).

        Only full blocks count, and never all of the request's tokens: at least the last token is
        recomputed, so the step that finishes the prefill has logits to sample from. The blocks are
        not referenced yet; pass them to `allocate_slots` in the same step. With a sliding window
        the prefix only needs the blocks the next query's window reaches; the entries before them
        are the null block. Nothing for a request that must compute every prompt token
        (`Request.skip_reading_prefix_cache`).
        """
        if not self.enable_prefix_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes(request, max_blocks)
        lookup = self.block_pool.cached_blocks.get
        if self.sliding_window is not None:
            return self._window_hit(hashes, max_blocks)
        blocks = []
        for i in range(max_blocks):
            block_id = lookup(hashes[i])
            if block_id is None:
                break
            blocks.append(block_id)
        if self.groups is not None and blocks:
            del blocks[self.groups.hit(request.request_id, hashes, blocks):]
        return blocks, len(blocks) * self.block_size

    def _window_hit(self, hashes: list[int], max_blocks: int) -> tuple[list[int], int]:
        """The longest prefix of k blocks whose last blocks, those the query at k * block_size can
        see, are all cached: one pass over the chain, tracking the run of cached blocks."""
        lookup, bs, window = self.block_pool.cached_blocks.get, self.block_size, self.sliding_window
        found: list[int | None] = [lookup(h) for h in hashes[:max_blocks]]
        best, run = 0, 0
        for k in range(1, max_blocks + 1):
            run = run + 1 if found[k - 1] is not None else 0
            if run and k - max(0, k * bs - window + 1) // bs <= run:
                best = k
        if not best:
            return [], 0
        first = max(0, best * bs - window + 1) // bs
        return [NULL_BLOCK_ID] * first + found[first:best], best * bs  # type: ignore[list-item]

    # ------------------------------------------------------------------ allocation
    def block_table(self, request: Request) -> tuple[int, ...]:
        """`tuple(request.block_ids)`, built once per change of the table (`block_tables[id]`
        directly is the same for a request that holds blocks)."""
        table = self.block_tables.get(request.request_id)
        if table is None:
            table = self.block_tables[request.request_id] = tuple(request.block_ids)
        return table

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = ()) -> bool:
        """Grow `request.block_ids` to cover `num_computed_tokens + computed hits + num_new_tokens`.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks` (only for a request
        that holds no blocks yet); they are referenced and put first in the table. Returns False,
        changing nothing (but freeing blocks behind a sliding window, which no query reads again),
        when the pool cannot supply the blocks. The caller sets
        `num_computed_tokens` (it must add the hit tokens itself). The hot path (a decode that
        still fits its last block) is a few integer operations.
        """
        block_ids = request.block_ids
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        total_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_needed = -(-total_tokens // self.block_size) - len(block_ids) - len(new_computed_blocks)
        if num_needed <= 0 and not new_computed_blocks:
            return True
        pool, groups, request_id = self.block_pool, self.groups, request.request_id
        fresh_admission = not block_ids
        if self.sliding_window is not None and block_ids:
            self._free_behind_window(request)
        if new_computed_blocks:
            assert not block_ids, "prefix hits can only start an empty block table"
            # Hits that sit in the free queue stop being allocatable once referenced (the null
            # entries of a windowed hit are no blocks at all).
            num_evictable_hits = sum(1 for b in new_computed_blocks if pool.ref_cnt[b] == 0 and b)
        else:
            num_evictable_hits = 0
        num_pages = max(num_needed, 0) + num_evictable_hits
        if groups is not None:
            length = len(block_ids) + len(new_computed_blocks) + max(num_needed, 0)
            groups.free_behind(request_id, request.num_computed_tokens)
            num_pages += groups.num_needed(request_id, length, bool(new_computed_blocks))
            if new_computed_blocks:
                num_pages += groups.num_evictable_hits(request_id)
        if num_pages > pool.num_free_blocks:
            return False
        if new_computed_blocks:
            pool.touch(b for b in new_computed_blocks if b)
            block_ids.extend(new_computed_blocks)
            self._num_cached_blocks[request_id] = len(new_computed_blocks)
        if groups is not None:     # every hit referenced before any page leaves the free queue
            groups.adopt(request_id, bool(new_computed_blocks))
        if num_needed > 0:
            block_ids.extend(pool.get_new_blocks(num_needed))
        if groups is not None:
            groups.extend(request_id, length)
        self.block_tables[request.request_id] = tuple(block_ids)
        if fresh_admission:
            self.num_queried_tokens += request.num_tokens
            self.num_hit_tokens += num_hit_tokens
        return True

    def _free_behind_window(self, request: Request) -> None:
        """Free the request's blocks that no query from `num_computed_tokens` on can see (wholly
        before `num_computed_tokens - window + 1`), oldest first; their entries become null."""
        first_needed = self.first_block_in_window(request.num_computed_tokens)
        request_id = request.request_id
        done = self._num_freed.get(request_id, 0)
        if first_needed <= done:
            return
        block_ids = request.block_ids
        self.block_pool.free_blocks([b for b in block_ids[done:first_needed] if b])
        block_ids[done:first_needed] = [NULL_BLOCK_ID] * (first_needed - done)
        self._num_freed[request_id] = first_needed
        self.block_tables[request_id] = tuple(block_ids)

    def reserve(self, request: Request, num_tokens: int) -> bool:
        """Decode role: allocate blocks for `num_tokens` tokens whose KV will arrive from a peer.

        With a window only the blocks from `first_block_in_window(num_tokens)` on (the null block
        before them, already counted as freed and never cached): no query from `num_tokens` on
        reads the others, so the peer does not send them. With KV groups, group 0 (full) gets
        every block and each windowed group its pages from its window's start (`GroupTables.reserve`).
        The request must hold no blocks. Returns False, changing nothing, when they do not fit.
        """
        assert not request.block_ids, f"request {request.request_id} already holds blocks"
        first = self.first_block_in_window(num_tokens)
        num_needed = self.num_blocks_to_reserve(num_tokens)
        if num_needed > self.block_pool.num_free_blocks:
            return False
        if self.groups is not None:
            num_blocks = self.num_blocks_for(num_tokens)
            request.block_ids.extend(self.block_pool.get_new_blocks(num_blocks))
            self.groups.reserve(request.request_id, num_blocks, num_tokens)
            self.block_tables[request.request_id] = tuple(request.block_ids)
            return True
        if first:
            request.block_ids.extend([NULL_BLOCK_ID] * first)
            self._num_freed[request.request_id] = self._num_cached_blocks[request.request_id] = first
        request.block_ids.extend(self.block_pool.get_new_blocks(num_needed))
        self.block_tables[request.request_id] = tuple(request.block_ids)
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that became full (and computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        request_id = request.request_id
        start = self._num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        self.block_pool.cache_full_blocks(request.block_ids, hashes, start, num_full)
        if self.groups is not None:
            self.groups.cache(request_id, hashes, start, num_full)
        self._num_cached_blocks[request_id] = num_full

    def free(self, request: Request) -> None:
        """Release all the request's blocks (tail first, so its tail is evicted before its prefix).

        Also drops the manager's per-request caches; safe on a request that holds no blocks.
        """
        self.block_pool.free_blocks([b for b in reversed(request.block_ids) if b])
        if self.groups is not None:
            self.groups.free(request.request_id)
        request.block_ids.clear()
        self.block_tables.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._block_hashes.pop(request.request_id, None)
        self._num_freed.pop(request.request_id, None)
