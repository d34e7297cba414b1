"""Maps requests onto the block pool: prefix lookup, growing block tables, caching, freeing.

The manager owns no request state beyond per-request caches keyed by request id — the hash chain
of the request's full blocks (computed incrementally, so caching costs O(new blocks)), how many of
its blocks are already registered in the prefix cache, and an immutable copy of its block table. A
request's block table is `request.block_ids`, which only this manager changes; block `i` holds the
KV of `token_ids[i * block_size:(i + 1) * block_size]`.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_pool import ROOT_BLOCK_HASH, BlockPool, hash_block_tokens
from engine.request import Request


class KVCacheManager:
    """vLLM-style KV cache manager over one `BlockPool`."""

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_pool = block_pool
        self.block_size = block_size
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

    # ------------------------------------------------------------------ prefix lookup
    def _hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """The request's block-hash chain, extended to at least `num_full_blocks` blocks."""
        hashes = self._block_hashes.get(request.request_id)
        if hashes is None:
            hashes = self._block_hashes[request.request_id] = []
        if len(hashes) < num_full_blocks:
            bs, tokens, chain = self.block_size, request.token_ids, hash_block_tokens
            parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
            for i in range(len(hashes), num_full_blocks):
                parent = chain(parent, tokens[i * bs:(i + 1) * bs])
                hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request: (block ids, number of tokens they cover).

        Only full blocks count, and never all of the request's tokens: at least the last token is
        recomputed, so the step that finishes the prefill has logits to sample from. The blocks are
        not referenced yet; pass them to `allocate_slots` in the same step. None for a request that
        must compute every prompt token (`Request.skip_reading_prefix_cache`).
        """
        if not self.enable_prefix_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes(request, max_blocks)
        lookup = self.block_pool.cached_blocks.get
        blocks = []
        for i in range(max_blocks):
            block_id = lookup(hashes[i])
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

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
        changing nothing, when the pool cannot supply the blocks. The caller sets
        `num_computed_tokens` (it must add the hit tokens itself). The hot path (a decode that
        still fits its last block) is a few integer operations.
        """
        block_ids = request.block_ids
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        total_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_needed = -(-total_tokens // self.block_size) - len(block_ids) - len(new_computed_blocks)
        if num_needed <= 0 and not new_computed_blocks:
            return True
        pool = self.block_pool
        fresh_admission = not block_ids
        if new_computed_blocks:
            assert not block_ids, "prefix hits can only start an empty block table"
            # Hits that sit in the free queue stop being allocatable once referenced.
            num_evictable_hits = sum(1 for b in new_computed_blocks if pool.ref_cnt[b] == 0)
        else:
            num_evictable_hits = 0
        if max(num_needed, 0) + num_evictable_hits > pool.num_free_blocks:
            return False
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            block_ids.extend(new_computed_blocks)
            self._num_cached_blocks[request.request_id] = len(new_computed_blocks)
        if num_needed > 0:
            block_ids.extend(pool.get_new_blocks(num_needed))
        self.block_tables[request.request_id] = tuple(block_ids)
        if fresh_admission:
            self.num_queried_tokens += request.num_tokens
            self.num_hit_tokens += num_hit_tokens
        return True

    def reserve(self, request: Request, num_tokens: int) -> bool:
        """Decode role: allocate blocks for `num_tokens` tokens whose KV will arrive from a peer.

        The request must hold no blocks. Returns False, changing nothing, when they do not fit.
        """
        assert not request.block_ids, f"request {request.request_id} already holds blocks"
        num_needed = self.num_blocks_for(num_tokens)
        if num_needed > self.block_pool.num_free_blocks:
            return False
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
        self.block_pool.cache_full_blocks(request.block_ids, self._hashes(request, num_full), start, num_full)
        self._num_cached_blocks[request_id] = num_full

    def free(self, request: Request) -> None:
        """Release all the request's blocks (tail first, so its tail is evicted before its prefix).

        Also drops the manager's per-request caches; safe on a request that holds no blocks.
        """
        self.block_pool.free_blocks(reversed(request.block_ids))
        request.block_ids.clear()
        self.block_tables.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._block_hashes.pop(request.request_id, None)
