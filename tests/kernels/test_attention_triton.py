"""Triton paged attention (unified and split-K) against the torch reference.

Under TRITON_INTERPRET=1 these run on CPU tensors; shapes are tiny because the interpreter is slow.
Tolerances: fp32 1e-4 (ieee dots), fp16 atol 5e-3 / rtol 1e-2 (P is rounded to fp16 for P @ V).
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.attention_ref import paged_attention_ref
from paged_cases import make_case, naive_attention

MIXED = [(0, 7), (13, 1), (20, 5), (33, 1), (0, 1), (5, 19)]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=1e-2)}


def _check(case, dtype: torch.dtype, out: torch.Tensor | None = None) -> None:
    if out is None:
        out = kernels.paged_attention(*case.args())
    ref = paged_attention_ref(*case.args(), out_dtype=torch.float32)
    assert out.dtype == dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.parametrize(
    "block_size, head_dim, group, dtype",
    [
        (16, 32, 1, torch.float32),
        (1, 32, 2, torch.float32),
        (32, 64, 4, torch.float32),
        (16, 80, 2, torch.float32),  # head_dim not a power of two: masked padding to 128
        (16, 64, 2, torch.float16),
        (32, 32, 4, torch.float16),
        (1, 80, 1, torch.float16),
    ],
)
def test_unified_mixed_batch(triton_backend, block_size: int, head_dim: int, group: int,
                             dtype: torch.dtype) -> None:
    case = make_case(MIXED, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size,
                     dtype=dtype, device=triton_backend)
    _check(case, dtype)


def test_unified_tile_spans_blocks_and_parts_of_blocks(triton_backend) -> None:
    from kernels.attention_triton import launch_unified

    # Several blocks per key tile; part of one block; and bigger query tiles (the GPU prefill size).
    for block_size, block_n, block_m in [(16, 64, 16), (32, 16, 16), (16, 32, 64)]:
        case = make_case([(21, 3), (40, 1), (7, 37)], num_kv_heads=1, group=4, head_dim=32,
                         block_size=block_size, device=triton_backend)
        _check(case, torch.float32, launch_unified(*case.args(), block_n=block_n, block_m=block_m))


@pytest.mark.parametrize(
    "block_m, block_n, split_decodes, group, head_dim, dtype",
    [
        (16, 32, True, 4, 32, torch.float32),
        (64, 16, True, 2, 64, torch.float32),
        (128, 64, True, 4, 32, torch.float32),  # the GPU's prefill tiles: 32 tokens x 4 heads
        (128, 32, True, 3, 80, torch.float16),  # group padded to 4, head_dim padded to 128
        (64, 32, False, 4, 32, torch.float16),  # decodes inside 64-row tiles (the old mixed path)
        (16, 16, True, 8, 32, torch.float32),  # group 8: 16 decode rows, 2 tokens per tile
    ],
)
def test_unified_split_decodes_mixed_batch(triton_backend, block_m, block_n, split_decodes, group, head_dim,
                                           dtype) -> None:
    from kernels.attention_triton import launch_unified

    # Decodes before, between and after chunks; a 1-token prefill (context 0); a decode whose context
    # ends exactly on a key tile; chunks shorter and longer than one query tile.
    specs = [(31, 1), (0, 7), (13, 1), (20, 40), (32, 1), (0, 1), (5, 19), (70, 1)]
    case = make_case(specs, num_kv_heads=2, group=group, head_dim=head_dim, block_size=16, dtype=dtype,
                     device=triton_backend)
    _check(case, dtype, launch_unified(*case.args(), block_n=block_n, block_m=block_m,
                                       split_decodes=split_decodes))


def test_unified_split_decodes_without_prefill_and_without_decodes(triton_backend) -> None:
    from kernels.attention_triton import launch_unified

    # All decode programs (every query tile exits), then all query tiles (every decode program exits).
    for specs in ([(9, 1), (40, 1), (0, 1)], [(9, 3), (0, 17)]):
        case = make_case(specs, num_kv_heads=2, group=2, head_dim=32, block_size=16, device=triton_backend)
        _check(case, torch.float32, launch_unified(*case.args(), block_m=32, split_decodes=True))


def test_unified_chunked_continuation_matches_one_shot_prefill(triton_backend) -> None:
    # The same 30-token sequence as one prefill and as a 12-token chunk after 18 cached tokens:
    # the chunk's outputs equal the last 12 rows of the one-shot prefill.
    full = make_case([(0, 30)], num_kv_heads=2, group=2, head_dim=32, block_size=16, device=triton_backend)
    out_full = kernels.paged_attention(*full.args())
    chunk_qsl = torch.tensor([0, 12], dtype=torch.int32, device=triton_backend)
    out_chunk = kernels.paged_attention(full.q[18:], full.key_cache, full.value_cache, full.block_tables,
                                        full.seq_lens, chunk_qsl, full.scale)
    torch.testing.assert_close(out_chunk, out_full[18:], atol=1e-5, rtol=1e-5)


def test_block_offsets_beyond_int32(triton_backend) -> None:
    # Per-block stride 2*2*16*1*32 = 2048 elements; blocks past 2**20 put offsets beyond 2**31.
    first = 2**20 + 64
    case = make_case([(20, 4), (37, 1)], num_kv_heads=1, group=2, head_dim=32, block_size=16,
                     dtype=torch.float16, device=triton_backend, first_block=first, num_blocks=first + 16)
    assert int(case.block_tables.min()) == 0 and case.block_tables.max() * case.key_cache.stride(0) > 2**31
    _check(case, torch.float16)
    from kernels.attention_splitk_triton import launch_split_k

    decode = make_case([(37, 1), (50, 1)], num_kv_heads=1, group=2, head_dim=32, block_size=16,
                       dtype=torch.float16, device=triton_backend, first_block=first, num_blocks=first + 16)
    _check(decode, torch.float16, launch_split_k(*decode.args(), partition=32, block_n=16))


@pytest.mark.parametrize(
    "block_size, head_dim, group, dtype",
    [(16, 32, 1, torch.float32), (1, 64, 4, torch.float32), (32, 80, 2, torch.float16)],
)
def test_split_k_decode(triton_backend, block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    from kernels.attention_splitk_triton import launch_split_k

    # Partitions of 32 keys: contexts cover 1..4 partitions, one ends exactly on a boundary, and
    # the extra table columns give every sequence some empty trailing partitions.
    case = make_case([(0, 1), (31, 1), (70, 1), (95, 1)], num_kv_heads=2, group=group, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, device=triton_backend, extra_table_cols=3)
    _check(case, dtype, launch_split_k(*case.args(), partition=32, block_n=16))


def test_launcher_picks_split_k_for_small_long_decode(triton_backend) -> None:
    from kernels.attention_splitk_triton import PARTITION, use_split_k

    assert use_split_k(num_seqs=2, num_kv_heads=8, max_context=4096)
    assert not use_split_k(num_seqs=64, num_kv_heads=8, max_context=4096)  # enough programs already
    assert not use_split_k(num_seqs=2, num_kv_heads=8, max_context=PARTITION)  # nothing to split
    # A wide block table (2 * PARTITION keys of capacity) routes a decode batch through split-K.
    case = make_case([(9, 1), (40, 1)], num_kv_heads=1, group=2, head_dim=32, block_size=32,
                     device=triton_backend, extra_table_cols=2 * PARTITION // 32)
    _check(case, torch.float32)


def test_launch_rejects_bad_tile(triton_backend) -> None:
    from kernels.attention_splitk_triton import launch_split_k
    from kernels.attention_triton import launch_unified

    case = make_case([(3, 2)], num_kv_heads=1, group=1, head_dim=32, block_size=16, device=triton_backend)
    with pytest.raises(ValueError, match="block_n"):
        launch_unified(*case.args(), block_n=8)
    with pytest.raises(ValueError, match="block_m"):
        launch_unified(*case.args(), block_m=24)
    with pytest.raises(ValueError, match="one query token per sequence"):
        launch_split_k(*case.args())


def test_split_k_single_partition(triton_backend) -> None:
    from kernels.attention_splitk_triton import launch_split_k

    case = make_case([(5, 1), (20, 1)], num_kv_heads=2, group=2, head_dim=32, block_size=16, device=triton_backend)
    _check(case, torch.float32, launch_split_k(*case.args()))  # default 512-key partition: just one


@pytest.mark.parametrize("block_m, split_decodes", [(64, False), (128, True)], ids=["old-gpu-tiles", "gpu-tiles"])
def test_fp16_last_lone_row_of_a_chunk_over_long_context(triton_backend, block_m: int, split_decodes: bool) -> None:
    # The shape of the H200 fp16 failure (test_attention_larger_shapes: 0.027 at the last token of a
    # 129-token chunk over 3,000 cached tokens), scaled down with the same structure: Llama-3-like
    # heads, the GPU's key tile (64) and query tiles, a chunk of one query tile + 1 token whose last
    # row sits alone in its tile, ~23x more context than chunk, next to prefills and decodes. Checked
    # against dense float64 attention (not the paged reference), row by row at the lone row.
    from kernels.attention_triton import launch_unified

    specs = [(0, 70), (150, 30), (204, 1), (90, 1), (750, block_m // 4 + 1)]
    case = make_case(specs, num_kv_heads=2, group=4, head_dim=128, block_size=16, dtype=torch.float16,
                     device=triton_backend)
    out = launch_unified(*case.args(), block_n=64, block_m=block_m, split_decodes=split_decodes)
    want = naive_attention(case)
    torch.testing.assert_close(out[-1].double(), want[-1], **TOL[torch.float16])
    torch.testing.assert_close(out.double(), want, **TOL[torch.float16])
