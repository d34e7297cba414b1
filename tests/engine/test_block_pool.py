"""BlockPool: null block, LRU free queue, reference counts, prefix-cache entries and eviction."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.block_pool import NULL_BLOCK_ID, ROOT_BLOCK_HASH, BlockPool, hash_block_tokens


def test_allocates_every_block_but_the_null_block():
    pool = BlockPool(8)
    assert pool.num_free_blocks == 7 and pool.usage == 0.0
    blocks = pool.get_new_blocks(7)
    assert sorted(blocks) == list(range(1, 8)) and NULL_BLOCK_ID not in blocks
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    pool.check_invariants()


def test_rejects_a_pool_without_usable_blocks():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_freed_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(5)
    a, b, c, d = pool.get_new_blocks(4)
    pool.free_blocks([c, a])
    pool.free_blocks([d])
    assert pool.get_new_blocks(3) == [c, a, d]
    pool.check_invariants()


def test_shared_block_is_free_only_after_its_last_reference():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert pool.ref_cnt[block] == 2
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3 and pool.usage == 0.0
    pool.check_invariants()


def test_freed_cached_block_stays_hittable_and_touch_takes_it_out_of_the_free_queue():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2])
    assert pool.cache_full_block(block, h)
    pool.free_blocks([block])
    assert pool.get_cached_block(h) == block
    assert pool.num_free_blocks == 3          # cached-but-unreferenced counts as free
    pool.touch([block])
    assert pool.ref_cnt[block] == 1 and pool.num_free_blocks == 2
    pool.check_invariants()


def test_allocation_evicts_the_cache_entry_of_a_reused_block():
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2)
    h1, h2 = hash_block_tokens(ROOT_BLOCK_HASH, [1]), hash_block_tokens(ROOT_BLOCK_HASH, [2])
    pool.cache_full_block(first, h1)
    pool.cache_full_block(second, h2)
    pool.free_blocks([second, first])         # second is nearer the head: evicted first
    assert pool.get_new_blocks(1) == [second]
    assert pool.get_cached_block(h2) is None and pool.get_cached_block(h1) == first
    assert pool.num_cached_blocks == 1
    pool.check_invariants()


def test_duplicate_content_keeps_the_first_copy_canonical():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(ROOT_BLOCK_HASH, [5, 6])
    assert pool.cache_full_block(a, h)
    assert not pool.cache_full_block(b, h)
    assert not pool.cache_full_block(a, h)    # already cached
    assert pool.get_cached_block(h) == a and pool.block_hash[b] is None
    pool.check_invariants()


def test_caching_disabled_never_caches():
    pool = BlockPool(4, enable_prefix_caching=False)
    (block,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(block, 123)
    assert pool.get_cached_block(123) is None


def test_reset_prefix_cache_drops_only_unreferenced_entries():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 1)
    pool.cache_full_block(b, 2)
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() == 1
    assert pool.get_cached_block(1) is None and pool.get_cached_block(2) == b
    pool.check_invariants()


def test_hash_chain_depends_on_the_whole_prefix():
    h1 = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(hash_block_tokens(ROOT_BLOCK_HASH, [9, 2]), [3, 4])
    assert hash_block_tokens(h1, (3, 4)) == hash_block_tokens(h1, [3, 4])


def test_hash_chain_is_the_same_in_another_process_with_another_hash_seed():
    code = ("from engine.block_pool import ROOT_BLOCK_HASH as R, hash_block_tokens as h;"
            "print(h(h(R, [1, 2, 3]), [4, 5, 6]))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    here = hash_block_tokens(hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3]), [4, 5, 6])
    assert int(other.stdout) == here


def test_check_invariants_catches_a_double_free_and_a_stale_cache_entry():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    pool.ref_cnt[block] = 1                   # referenced yet in the free queue
    with pytest.raises(AssertionError, match="free queue"):
        pool.check_invariants()
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, 7)
    pool.block_hash[block] = 8
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_cache_full_blocks_registers_a_range_like_single_calls():
    pool, single = BlockPool(8), BlockPool(8)
    blocks = pool.get_new_blocks(4)
    assert single.get_new_blocks(4) == blocks
    hashes = [11, 12, 11, 13]                  # block 2 repeats block 0's content: not cached
    pool.cache_full_blocks(blocks, hashes, 0, 4)
    for block_id, content_hash in zip(blocks, hashes):
        single.cache_full_block(block_id, content_hash)
    assert pool.cached_blocks == single.cached_blocks == {11: blocks[0], 12: blocks[1], 13: blocks[3]}
    assert pool.block_hash == single.block_hash
    off = BlockPool(4, enable_prefix_caching=False)
    off.cache_full_blocks(off.get_new_blocks(2), [1, 2], 0, 2)
    assert off.num_cached_blocks == 0
