"""The KV block pool: pure Python over block ids, with reference counts and a prefix cache.

Every block except block 0 (the null block, never handed out) is in exactly one of two states:
- *referenced*: `ref_cnt > 0`, owned by that many requests' block tables;
- *free*: `ref_cnt == 0`, in the free queue, allocatable. A free block may still hold a prefix-cache
  entry ("cached but unreferenced"); it is reused by a later request that hits its hash (`touch`
  pulls it out of the free queue) or evicted when allocation reaches it.

The free queue is an LRU: freed blocks go to the tail, allocation takes from the head, so the
blocks whose cache entries survive longest are the ones freed most recently. It is an
`OrderedDict` used as a doubly linked list: append, pop-from-head and removal from the middle (a
cached free block being reused) are all O(1) and run in C.

Prefix caching hashes FULL blocks only, chained so that a block's hash covers the whole prefix up
to its end: `hash_block_tokens(parent_hash, tokens) = hash((parent_hash, tuple(tokens)))`, with
`ROOT_BLOCK_HASH` as the parent of a sequence's first block. Python's hash of a tuple of ints does
not depend on PYTHONHASHSEED (only str/bytes hashing is salted), so the chain is identical across
processes and machines with the same pointer width (64-bit everywhere we run) — a router or a
peer pod can compute it too. `None` is deliberately not used as the root: before Python 3.12 its
hash is its address. The hash is 64 bits, so two different prefixes colliding is ~2^-64 per pair:
accepted, as in vLLM's default (it offers sha256 for the paranoid).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

NULL_BLOCK_ID = 0
ROOT_BLOCK_HASH = 0x9E3779B97F4A7C15  # fixed, arbitrary parent hash of a sequence's first block


def hash_block_tokens(parent_hash: int, block_tokens: Sequence[int]) -> int:
    """Hash of one full block, chained on the hash of the block before it (`ROOT_BLOCK_HASH` first)."""
    return hash((parent_hash, tuple(block_tokens)))


class BlockPool:
    """Fixed set of `num_blocks` KV blocks (ids `0..num_blocks-1`, block 0 reserved as null)."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt: list[int] = [0] * num_blocks
        # block id -> hash of its content while it holds a cache entry, else None.
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached_blocks: dict[int, int] = {}   # block hash -> block id
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))

    # ------------------------------------------------------------------ accounting
    @property
    def num_usable_blocks(self) -> int:
        """All blocks a request could ever hold (everything but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Allocatable blocks, counting cached-but-unreferenced ones (they are evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by some request, in [0, 1]."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    # ------------------------------------------------------------------ allocation
    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the LRU head (evicting their cache entries), refcount 1 each."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks, only {len(self._free)} free")
        free, ref_cnt, block_hash = self._free, self.ref_cnt, self.block_hash
        blocks = []
        for _ in range(num_blocks):
            block_id, _ = free.popitem(last=False)
            if block_hash[block_id] is not None:
                self._evict(block_id)
            ref_cnt[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Add a reference to each block (prefix-cache hits); a free cached block leaves the free queue."""
        free, ref_cnt = self._free, self.ref_cnt
        for block_id in blocks:
            if ref_cnt[block_id] == 0:
                del free[block_id]
            ref_cnt[block_id] += 1

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in order; at zero it joins the free queue's tail.

        Its cache entry is kept, so a later request can still hit it until it is evicted. Callers
        pass a request's blocks in reverse, so its tail blocks sit nearer the head (evicted first)
        and the shared prefix survives longest.
        """
        free, ref_cnt = self._free, self.ref_cnt
        for block_id in blocks:
            ref_cnt[block_id] -= 1
            if ref_cnt[block_id] == 0:
                free[block_id] = None

    # ------------------------------------------------------------------ prefix cache
    def get_cached_block(self, block_hash: int) -> int | None:
        """The block holding content with this chained hash, or None."""
        return self.cached_blocks.get(block_hash)

    def cache_full_block(self, block_id: int, block_hash: int) -> bool:
        """Register a referenced, full, computed block under its chained hash.

        Returns False (and caches nothing) when caching is off, the block is already cached, or
        another block already holds the same content: the first copy stays the canonical one and
        this block is freed uncached later.
        """
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return False
        if block_hash in self.cached_blocks:
            return False
        self.cached_blocks[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        return True

    def cache_full_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[int], start: int, stop: int) -> None:
        """`cache_full_block(block_ids[i], block_hashes[i])` for `i` in `[start, stop)`, in one call
        (the manager caches a block per request every `block_size` decode steps: the hot path)."""
        if not self.enable_prefix_caching:
            return
        block_hash, cached_blocks = self.block_hash, self.cached_blocks
        for i in range(start, stop):
            block_id, content_hash = block_ids[i], block_hashes[i]
            if block_hash[block_id] is None and content_hash not in cached_blocks:
                cached_blocks[content_hash] = block_id
                block_hash[block_id] = content_hash

    def _evict(self, block_id: int) -> None:
        del self.cached_blocks[self.block_hash[block_id]]
        self.block_hash[block_id] = None

    def reset_prefix_cache(self) -> int:
        """Drop the cache entries of all unreferenced blocks; returns how many were dropped."""
        evicted = [b for b in self._free if self.block_hash[b] is not None]
        for block_id in evicted:
            self._evict(block_id)
        return len(evicted)

    # ------------------------------------------------------------------ testing
    def check_invariants(self) -> None:
        """Raise AssertionError unless every non-null block is free xor referenced and the cache map is
        consistent. O(num_blocks): for tests, never on the hot path."""
        assert self.ref_cnt[NULL_BLOCK_ID] == 0, "null block was referenced"
        assert NULL_BLOCK_ID not in self._free, "null block is in the free queue"
        assert len(self._free) <= self.num_blocks - 1
        for block_id in range(1, self.num_blocks):
            ref = self.ref_cnt[block_id]
            assert ref >= 0, f"block {block_id} has negative refcount {ref}"
            assert (ref == 0) == (block_id in self._free), (
                f"block {block_id}: refcount {ref} but {'in' if block_id in self._free else 'not in'} free queue")
        for block_hash, block_id in self.cached_blocks.items():
            assert self.block_hash[block_id] == block_hash, f"cache map points at block {block_id} with another hash"
        num_hashed = sum(h is not None for h in self.block_hash)
        assert num_hashed == len(self.cached_blocks), "a block has a hash but no cache entry"
        assert self.block_hash[NULL_BLOCK_ID] is None
