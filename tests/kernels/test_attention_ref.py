"""The torch paged-attention reference (the CPU runtime path) against naive dense attention."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import checks
from kernels.attention_ref import paged_attention_ref
from paged_cases import make_case, naive_attention

MIXED = [(0, 7), (13, 1), (20, 5), (33, 1), (0, 1), (5, 19)]


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_reference_matches_dense_attention(block_size: int, group: int) -> None:
    case = make_case(MIXED, num_kv_heads=2, group=group, head_dim=32, block_size=block_size)
    out = paged_attention_ref(*case.args())
    torch.testing.assert_close(out.double(), naive_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("specs", [[(0, 9)], [(17, 1), (3, 1), (40, 1)], [(8, 4), (0, 3)]],
                         ids=["prefill", "decode-only", "chunked"])
def test_reference_batch_shapes(specs: list[tuple[int, int]]) -> None:
    case = make_case(specs, num_kv_heads=1, group=4, head_dim=80, block_size=16)
    torch.testing.assert_close(paged_attention_ref(*case.args()).double(), naive_attention(case),
                               atol=1e-5, rtol=1e-5)


def test_reference_half_precision_returns_input_dtype() -> None:
    case = make_case(MIXED, num_kv_heads=2, group=2, head_dim=64, block_size=16, dtype=torch.float16)
    out = paged_attention_ref(*case.args())
    assert out.dtype == torch.float16 and out.shape == case.q.shape
    torch.testing.assert_close(out.double(), naive_attention(case), atol=2e-3, rtol=1e-2)


def test_public_function_uses_reference_on_cpu(auto_backend) -> None:
    case = make_case(MIXED, num_kv_heads=2, group=2, head_dim=32, block_size=16)
    assert torch.equal(kernels.paged_attention(*case.args()), paged_attention_ref(*case.args()))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(q=a["q"][0]), "q must be"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:-1]), "seq_lens"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"].long()), "query_start_loc"),
        (lambda a: a.update(q=a["q"][:, :3]), "multiple of num_kv_heads"),
        (lambda a: a.update(q=a["q"].half()), "dtype mismatch"),
        (lambda a: a.update(value_cache=a["value_cache"][:, :, :1]), "value_cache shape"),
    ],
    ids=["q-rank", "table-dtype", "seq-lens-len", "qsl-dtype", "heads", "dtype", "v-shape"],
)
def test_paged_attention_rejects_bad_inputs(mutate, message: str) -> None:
    case = make_case([(3, 2)], num_kv_heads=2, group=2, head_dim=32, block_size=16)
    args = dict(q=case.q, key_cache=case.key_cache, value_cache=case.value_cache,
                block_tables=case.block_tables, seq_lens=case.seq_lens,
                query_start_loc=case.query_start_loc, scale=case.scale)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        kernels.paged_attention(**args)


def test_check_returns_the_sizes_the_launchers_use() -> None:
    case = make_case([(3, 2), (20, 1)], num_kv_heads=2, group=3, head_dim=24, block_size=8)
    sizes = checks.check_paged_attention(*case.args()[:-1])
    assert sizes == checks.paged_attention_sizes(case.q, case.key_cache, case.block_tables)
    assert (sizes.num_tokens, sizes.num_heads, sizes.head_dim) == (3, 6, 24)
    assert (sizes.num_kv_heads, sizes.group, sizes.block_size, sizes.num_seqs) == (2, 3, 8, 2)
    assert sizes.max_context == case.block_tables.shape[1] * 8 >= 21


def test_transformers_does_not_mistake_us_for_hub_kernels() -> None:
    # transformers probes for a distribution providing `kernels`; ours must not pass its check.
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    assert not import_utils.is_kernels_available()


def test_reference_equal_length_decodes_skip_the_mask_and_stay_exact() -> None:
    # Equal contexts take the unmasked path: the tail of the last block (garbage) must not leak.
    case = make_case([(20, 1)] * 5, num_kv_heads=2, group=2, head_dim=32, block_size=16)
    torch.testing.assert_close(paged_attention_ref(*case.args()).double(), naive_attention(case),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("specs", [[(40, 1), (3, 1), (17, 1), (29, 1), (0, 1)],
                                   [(40, 1), (12, 6), (3, 1), (17, 1), (0, 9), (29, 1)]],
                         ids=["decode-only", "mixed"])
def test_reference_decode_chunks_match_one_batch(monkeypatch: pytest.MonkeyPatch, specs) -> None:
    # A tiny chunk budget splits the decode rows into one sequence per SDPA call.
    import kernels.attention_ref as attention_ref

    case = make_case(specs, num_kv_heads=2, group=2, head_dim=32, block_size=8)
    whole = paged_attention_ref(*case.args())
    monkeypatch.setattr(attention_ref, "DECODE_CHUNK_BYTES", 1)
    chunked = paged_attention_ref(*case.args())
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked.double(), naive_attention(case), atol=1e-5, rtol=1e-5)


def test_reference_reads_only_used_table_entries() -> None:
    # Unequal decode contexts pad to the longest: entries past a sequence's blocks may hold any id.
    case = make_case([(40, 1), (3, 1)], num_kv_heads=1, group=2, head_dim=16, block_size=8)
    want = paged_attention_ref(*case.args())
    case.block_tables[1, 1:] = 10**6  # would be out of range if gathered
    torch.testing.assert_close(paged_attention_ref(*case.args()), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_decode_chunks_reuse_half_precision_buffers(monkeypatch: pytest.MonkeyPatch, dtype) -> None:
    # Chunks gather into shared cache-dtype scratch buffers: each chunk must see only its own blocks,
    # including a last chunk shorter than the buffers and chunks of unequal lengths.
    import kernels.attention_ref as attention_ref

    case = make_case([(40, 1), (3, 1), (17, 1), (29, 1), (8, 1)], num_kv_heads=2, group=2, head_dim=32,
                     block_size=8, dtype=dtype)
    whole = paged_attention_ref(*case.args(), out_dtype=torch.float32)
    per_seq = 2 * 6 * 8 * 2 * 32 * 4  # K + V fp32 bytes of one padded sequence: 6 blocks of 8 tokens
    monkeypatch.setattr(attention_ref, "DECODE_CHUNK_BYTES", 2 * per_seq)  # chunks of 2, 2, 1 sequences
    chunked = paged_attention_ref(*case.args(), out_dtype=torch.float32)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked.double(), naive_attention(case), atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("specs", [MIXED, [(40, 1), (3, 1), (17, 1)], [(0, 9)], [(3000, 129)]],
                         ids=["mixed", "decode-only", "prefill", "long-chunk"])
def test_explicit_oracle_math_matches_dense_attention(monkeypatch: pytest.MonkeyPatch, specs) -> None:
    # Off the CPU the reference skips SDPA and does float64 math in query chunks: run that path here
    # (with chunks of a few rows) against the dense float64 attention.
    import kernels.attention_ref as attention_ref

    monkeypatch.setattr(attention_ref, "_explicit_math", lambda device: True)
    monkeypatch.setattr(attention_ref, "ORACLE_CHUNK_BYTES", 8 * 3 * 200 * 2)
    case = make_case(specs, num_kv_heads=2, group=2, head_dim=32, block_size=16, dtype=torch.float16)
    out = paged_attention_ref(*case.args(), out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), naive_attention(case), atol=1e-6, rtol=1e-6)
