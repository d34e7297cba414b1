"""KVCacheManager: block tables grow with tokens, prefix lookup over full blocks, caching, freeing."""

from __future__ import annotations

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling.params import SamplingParams


def make_manager(num_blocks: int = 16, block_size: int = 4, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, caching), block_size)


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


def compute(manager: KVCacheManager, request: Request, num_tokens: int) -> None:
    """What the scheduler does around a step: allocate, 'compute', cache the full blocks."""
    assert manager.allocate_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)


def test_block_table_grows_only_when_a_block_fills():
    manager = make_manager()
    request = make_request("a", range(10))
    assert manager.allocate_slots(request, 10)
    assert len(request.block_ids) == 3                 # ceil(10 / 4)
    request.num_computed_tokens = 10
    assert manager.allocate_slots(request, 2) and len(request.block_ids) == 3
    assert manager.allocate_slots(request, 3) and len(request.block_ids) == 4
    manager.block_pool.check_invariants()


def test_failed_allocation_changes_nothing():
    manager = make_manager(num_blocks=4)
    request = make_request("a", range(20))
    assert not manager.allocate_slots(request, 20)      # needs 5 blocks, 3 exist
    assert request.block_ids == [] and manager.num_free_blocks == 3
    assert manager.num_queried_tokens == 0


def test_prefix_lookup_hits_full_computed_blocks_and_counts_tokens():
    manager = make_manager()
    first = make_request("a", range(10))
    compute(manager, first, 10)                          # blocks [0..3], [4..7] full; [8, 9] partial
    second = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit = manager.get_computed_blocks(second)
    assert hits == first.block_ids[:2] and num_hit == 8
    assert manager.allocate_slots(second, second.num_tokens - num_hit, hits)
    assert second.block_ids[:2] == first.block_ids[:2] and len(second.block_ids) == 3
    assert manager.block_pool.ref_cnt[hits[0]] == 2
    assert manager.num_queried_tokens == 10 + 11 and manager.num_hit_tokens == 8
    assert abs(manager.hit_ratio - 8 / 21) < 1e-12
    manager.block_pool.check_invariants()


def test_never_serves_the_whole_prompt_from_the_cache():
    manager = make_manager()
    first = make_request("a", range(8))
    compute(manager, first, 8)
    again = make_request("b", range(8))
    hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 4 and len(hits) == 1               # the last block is recomputed


def test_lookup_stops_at_the_first_miss_because_hashes_chain():
    manager = make_manager()
    compute(manager, make_request("a", range(12)), 12)
    # Same second block, different first block: no hit at all.
    other = make_request("b", [99, 1, 2, 3] + list(range(4, 12)) + [0])
    assert manager.get_computed_blocks(other) == ([], 0)


def test_hits_on_freed_blocks_need_free_capacity_too():
    manager = make_manager(num_blocks=4)                 # 3 usable blocks
    first = make_request("a", range(9))
    compute(manager, first, 9)
    manager.free(first)
    assert manager.num_free_blocks == 3
    second = make_request("b", list(range(8)) + [7, 7, 7, 7, 7])
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 8
    # 2 hit blocks leave the free queue and 2 fresh ones are needed: 4 > 3.
    assert not manager.allocate_slots(second, second.num_tokens - num_hit, hits)
    assert second.block_ids == [] and manager.block_pool.ref_cnt[hits[0]] == 0
    assert manager.allocate_slots(second, 1, hits)       # 2 hits + 1 fresh fits
    manager.block_pool.check_invariants()


def test_free_releases_tail_first_so_the_prefix_outlives_it():
    manager = make_manager(num_blocks=5)                 # 4 usable blocks
    first = make_request("a", range(12))
    compute(manager, first, 12)
    table = list(first.block_ids)
    manager.free(first)
    assert first.block_ids == []
    pool = manager.block_pool
    # Free queue: the never-used block, then the request's blocks tail first.
    (never_used,) = set(range(1, 5)) - set(table)
    assert pool.get_new_blocks(3) == [never_used, table[2], table[1]]
    assert pool.block_hash[table[2]] is None and pool.block_hash[table[1]] is None
    assert pool.get_cached_block(pool.block_hash[table[0]]) == table[0]   # the prefix survives
    pool.check_invariants()


def test_cache_blocks_is_incremental_and_survives_chunking():
    manager = make_manager()
    request = make_request("a", range(16))
    compute(manager, request, 6)
    assert manager.block_pool.num_cached_blocks == 1
    compute(manager, request, 6)
    assert manager.block_pool.num_cached_blocks == 3
    compute(manager, request, 4)
    assert manager.block_pool.num_cached_blocks == 4
    probe = make_request("b", list(range(16)) + [1])
    assert manager.get_computed_blocks(probe)[1] == 16


def test_prefix_caching_off_means_no_hits():
    manager = make_manager(caching=False)
    compute(manager, make_request("a", range(12)), 12)
    assert manager.get_computed_blocks(make_request("b", range(12))) == ([], 0)
    assert manager.block_pool.num_cached_blocks == 0


def test_reserve_allocates_a_whole_prompt_or_nothing():
    manager = make_manager(num_blocks=4)
    request = make_request("a", range(9))
    assert manager.reserve(request, 9) and len(request.block_ids) == 3
    other = make_request("b", range(2))
    assert not manager.reserve(other, 2) and other.block_ids == []
    manager.free(request)
    assert manager.usage == 0.0


def test_block_table_tuple_follows_every_change_of_the_table():
    manager = make_manager(block_size=4)
    request = make_request("a", range(8))
    assert manager.allocate_slots(request, 8)
    first = manager.block_table(request)
    assert first == tuple(request.block_ids) and manager.block_table(request) is first   # built once
    assert manager.allocate_slots(request, 0)                    # no growth: the same tuple
    assert manager.block_table(request) is first
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 1)                    # a ninth token: one more block
    assert manager.block_table(request) == tuple(request.block_ids) and len(request.block_ids) == 3
    manager.free(request)
    assert "a" not in manager.block_tables
    assert manager.reserve(request, 5)
    assert manager.block_table(request) == tuple(request.block_ids) and len(request.block_ids) == 2


# ------------------------------------------------------------------ sliding windows
def make_window_manager(window: int, num_blocks: int = 32, block_size: int = 4) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, True), block_size, sliding_window=window)


def test_window_frees_the_blocks_behind_it_as_the_table_grows():
    manager = make_window_manager(window=6)
    request = make_request("a", range(40))
    compute(manager, request, 12)            # blocks 0..2 hold positions 0..11
    assert 0 not in request.block_ids
    # The next query (position 12) sees keys 7..12: block 0 (positions 0..3) is behind it; block 1
    # (4..7) is not. Freeing waits for the table to grow.
    compute(manager, request, 1)
    assert request.block_ids[0] == 0 and all(request.block_ids[1:])
    assert manager.block_table(request) == tuple(request.block_ids)
    free_before = manager.num_free_blocks
    for _ in range(15):                      # decode to position 28: one block out per block in
        compute(manager, request, 1)
    held = [b for b in request.block_ids if b]
    assert len(held) <= manager.max_blocks_held(request.num_tokens, 1) == (6 - 1) // 4 + 2
    assert manager.num_free_blocks >= free_before - 1
    manager.free(request)
    assert manager.num_free_blocks == manager.block_pool.num_usable_blocks
    manager.block_pool.check_invariants()


def test_window_hit_needs_only_the_blocks_the_window_reaches():
    manager = make_window_manager(window=5)
    first = make_request("a", range(20))
    compute(manager, first, 20)
    manager.free(first)                       # every full block stays cached, unreferenced
    # Evict blocks 0 and 1: a full-attention lookup would now miss everything.
    pool = manager.block_pool
    for block_hash in manager._hashes(make_request("x", range(20)), 2):
        pool._evict(pool.cached_blocks[block_hash])
    second = make_request("b", list(range(20)) + [7])
    hits, num_hit = manager.get_computed_blocks(second)
    # 20 computed positions, 5 full blocks; the query at 20 sees 16..20: only block 4 is needed,
    # but the longest prefix whose window is cached ends at 5 blocks (positions 16..19 cached).
    assert num_hit == 20 and hits[:4] == [0, 0, 0, 0] and hits[4]
    assert manager.allocate_slots(second, second.num_tokens - num_hit, hits)
    assert pool.ref_cnt[0] == 0 and pool.ref_cnt[hits[4]] == 1
    manager.block_pool.check_invariants()


def test_window_hit_never_uses_a_reused_block():
    manager = make_window_manager(window=9, num_blocks=8)
    first = make_request("a", range(16))
    compute(manager, first, 16)
    manager.free(first)
    hog = make_request("h", [99] * 28)       # takes every free block: the cached ones are reused
    compute(manager, hog, 28)
    assert manager.get_computed_blocks(make_request("b", list(range(16)) + [1])) == ([], 0)


def test_window_caps_the_blocks_a_request_holds():
    manager = make_window_manager(window=8, block_size=4)
    assert manager.max_blocks_held(1000, 1) == 3
    assert manager.max_blocks_held(1000, 16) == (8 + 16 - 2) // 4 + 2
    assert manager.max_blocks_held(6, 16) == 2               # short requests: their own size
    assert make_manager().max_blocks_held(1000, 1) == 250    # no window: everything


def test_window_reserve_takes_only_the_blocks_the_first_decode_reads():
    """Decode role: a 40-token prompt under a 6-token window reserves the blocks from the one
    holding position 40 - 6 + 1 = 35 on (null before them), caches only those once landed, and
    frees nothing more at its first decode step."""
    manager = make_window_manager(window=6)
    pool = manager.block_pool
    request = make_request("d", range(40))
    assert manager.first_block_in_window(40) == 35 // 4 == 8
    assert manager.num_blocks_to_reserve(40) == 2 <= manager.max_blocks_held(40, 1)
    assert manager.reserve(request, 40)
    assert request.block_ids[:8] == [0] * 8 and all(request.block_ids[8:]) and len(request.block_ids) == 10
    assert manager.num_free_blocks == pool.num_usable_blocks - 2
    request.num_computed_tokens = 40               # the pulled KV landed
    manager.cache_blocks(request, 40)
    assert pool.block_hash[0] is None and sum(h is not None for h in pool.block_hash) == 2
    compute(manager, request, 1)                   # the first decode: a new block, nothing freed
    assert manager.num_free_blocks == pool.num_usable_blocks - 3
    manager.free(request)
    assert manager.num_free_blocks == pool.num_usable_blocks
    pool.check_invariants()
    assert make_manager().num_blocks_to_reserve(40) == 10   # no window: the whole prompt
