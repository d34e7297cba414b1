"""Sliding-window attention and attention sinks in the paged kernels (reference, unified, split-K).

Every case is checked against dense float64 attention with transformers' masks (a query at p sees
keys (p - window, p]; sinks join the softmax and their column is dropped). The table entries of
blocks wholly before a sequence's first visible key point at a block full of NaN, as a freed
block would (the engine puts the null block there): one read of it and the output is NaN, so the
tests prove those tiles are skipped, not just masked. Interpreted Triton on CPU: tiny shapes.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.attention_ref import paged_attention_ref
from paged_cases import PagedCase, make_case, naive_attention

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=1e-2)}
# (context_len, query_len): decodes, a prefill from 0, chunks whose window edge falls inside the
# chunk, before it and inside the cached context; one chunk wholly past the window of its start.
SPECS = [(0, 9), (30, 1), (13, 6), (40, 12), (3, 1), (70, 1), (25, 30), (0, 1)]


def _free_out_of_window(case: PagedCase, window: int) -> int:
    """Point every table entry of a block no query of its sequence can see at a NaN block (one no
    sequence uses), as the engine frees them; returns how many were freed."""
    block_size = case.key_cache.shape[1]
    starts = case.query_start_loc.tolist()
    lens = case.seq_lens.tolist()
    in_use = {int(b) for i, n in enumerate(lens) for b in case.block_tables[i, : -(-n // block_size)].tolist()}
    poison = max(set(range(1, case.key_cache.shape[0])) - in_use)
    case.key_cache[poison] = float("nan")
    case.value_cache[poison] = float("nan")
    freed = 0
    for i, seq_len in enumerate(lens):
        context = seq_len - (starts[i + 1] - starts[i])
        n = max(0, context + 1 - window) // block_size
        case.block_tables[i, :n] = poison
        freed += n
    return freed


def _sinks(num_heads: int, device) -> torch.Tensor:
    return torch.linspace(-2.0, 3.0, num_heads).to(device)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 1000], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("block_size", [1, 16])
def test_reference_window_matches_dense(window: int, block_size: int) -> None:
    case = make_case(SPECS, num_kv_heads=2, group=2, head_dim=32, block_size=block_size)
    assert _free_out_of_window(case, window) or window >= 40
    out = paged_attention_ref(*case.args(), sliding_window=window)
    torch.testing.assert_close(out.double(), naive_attention(case, window), atol=1e-5, rtol=1e-5)


def _case(specs, *, group=2, head_dim=32, block_size=16, dtype=torch.float32, device="cpu", window=0, **kw):
    case = make_case(specs, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype,
                     device=device, **kw)
    if window:
        _free_out_of_window(case, window)
    return case


@pytest.mark.parametrize("window", [5, 17, 40, 1000], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_reference_sinks_and_windows_decode_and_mixed(window: int, sinks: bool) -> None:
    for specs in (SPECS, [(40, 1), (3, 1), (17, 1), (29, 1), (0, 1)]):
        case = _case(specs, window=window)
        s = _sinks(case.q.shape[1], "cpu") if sinks else None
        out = paged_attention_ref(*case.args(), sliding_window=window, sinks=s)
        torch.testing.assert_close(out.double(), naive_attention(case, window, s), atol=1e-5, rtol=1e-5)


def test_reference_window_decode_chunks_match_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels.attention_ref as attention_ref

    case = _case([(40, 1), (3, 1), (17, 1), (29, 1), (8, 1)], block_size=8, window=12)
    whole = paged_attention_ref(*case.args(), sliding_window=12)
    monkeypatch.setattr(attention_ref, "DECODE_CHUNK_BYTES", 1)
    chunked = paged_attention_ref(*case.args(), sliding_window=12)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)


def test_explicit_oracle_math_with_window_and_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels.attention_ref as attention_ref

    monkeypatch.setattr(attention_ref, "_explicit_math", lambda device: True)
    case = _case(SPECS, window=17)
    s = _sinks(case.q.shape[1], "cpu")
    out = paged_attention_ref(*case.args(), sliding_window=17, sinks=s)
    torch.testing.assert_close(out.double(), naive_attention(case, 17, s), atol=1e-6, rtol=1e-6)


def test_public_function_checks_window_and_sinks() -> None:
    case = _case([(3, 2)])
    with pytest.raises(ValueError, match="sliding_window"):
        kernels.paged_attention(*case.args(), sliding_window=-1)
    with pytest.raises(ValueError, match="sinks"):
        kernels.paged_attention(*case.args(), sinks=torch.zeros(3))


# ------------------------------------------------------------------ Triton (interpreted on CPU)
@pytest.mark.parametrize(
    "window, block_size, block_n, block_m, group, dtype",
    [
        (5, 16, 16, 16, 2, torch.float32),     # window shorter than a key tile
        (17, 16, 16, 32, 2, torch.float32),    # edges inside tiles; 2-token query tiles
        (40, 1, 32, 16, 4, torch.float32),     # block size 1
        (16, 16, 16, 64, 1, torch.float32),    # window = tile = block: edges on boundaries
        (1000, 16, 32, 16, 2, torch.float32),  # longer than every context: full attention
        (17, 16, 32, 128, 4, torch.float16),   # the GPU's prefill tiles, fp16
    ],
)
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_unified_window(triton_backend, window, block_size, block_n, block_m, group, dtype, sinks) -> None:
    from kernels.attention_triton import launch_unified

    case = _case(SPECS, group=group, block_size=block_size, dtype=dtype, device=triton_backend, window=window)
    s = _sinks(case.q.shape[1], triton_backend) if sinks else None
    out = launch_unified(*case.args(), block_n=block_n, block_m=block_m, split_decodes=True,
                         sliding_window=window, sinks=s)
    ref = paged_attention_ref(*case.args(), out_dtype=torch.float32, sliding_window=window, sinks=s)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    torch.testing.assert_close(out.double(), naive_attention(case, window, s), **TOL[dtype])


def test_unified_window_without_split_decodes(triton_backend) -> None:
    from kernels.attention_triton import launch_unified

    case = _case(SPECS, device=triton_backend, window=17)
    out = launch_unified(*case.args(), block_n=16, block_m=32, split_decodes=False, sliding_window=17)
    torch.testing.assert_close(out.double(), naive_attention(case, 17), **TOL[torch.float32])


def test_chunked_prefill_across_the_window_edge_matches_one_shot(triton_backend) -> None:
    # A 60-token prompt with a 20-key window, as one prefill and as chunks of 25, 20 and 15 tokens:
    # every chunk after the first starts past its first row's window edge, whose blocks are freed.
    window = 20
    full = _case([(0, 60)], device=triton_backend, block_size=8)
    want = kernels.paged_attention(*full.args(), sliding_window=window)
    torch.testing.assert_close(want.double(), naive_attention(full, window), **TOL[torch.float32])
    for start, stop in [(0, 25), (25, 45), (45, 60)]:
        table = full.block_tables.clone()
        table[0, : max(0, start + 1 - window) // 8] = 0   # the engine's null block
        seq_lens = torch.tensor([stop], dtype=torch.int32, device=triton_backend)
        qsl = torch.tensor([0, stop - start], dtype=torch.int32, device=triton_backend)
        out = kernels.paged_attention(full.q[start:stop], full.key_cache, full.value_cache, table, seq_lens, qsl,
                                      full.scale, sliding_window=window)
        torch.testing.assert_close(out, want[start:stop], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [7, 32, 50, 1000], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_split_k_window(triton_backend, window: int, sinks: bool) -> None:
    from kernels.attention_splitk_triton import launch_split_k

    # Partitions of 32 keys from each window's first key: contexts shorter and longer than the window.
    specs = [(0, 1), (31, 1), (70, 1), (95, 1), (6, 1)]
    case = _case(specs, device=triton_backend, window=window, extra_table_cols=3)
    s = _sinks(case.q.shape[1], triton_backend) if sinks else None
    out = launch_split_k(*case.args(), partition=32, block_n=16, sliding_window=window, sinks=s)
    torch.testing.assert_close(out.double(), naive_attention(case, window, s), **TOL[torch.float32])


def test_split_k_window_launches_only_the_windows_partitions(triton_backend, monkeypatch) -> None:
    import kernels.attention_splitk_triton as splitk
    from kernels.checks import paged_attention_sizes

    case = _case([(300, 1), (250, 1)], device=triton_backend, window=40, extra_table_cols=20)
    sizes = paged_attention_sizes(case.q, case.key_cache, case.block_tables)
    assert splitk.window_context(sizes, 40) == 40 and splitk.window_context(sizes, 0) == sizes.max_context
    # 40 keys span at most two 32-key partitions, whatever the context; the decision heuristic sees
    # the window too (a long table alone would pick split-K for nothing).
    launched = []
    real = splitk._split_k_partial_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(splitk, "_split_k_partial_kernel", Spy())
    out = splitk.launch_split_k(*case.args(), partition=32, block_n=16, sliding_window=40)
    assert launched == [(2, 2, 2)]
    torch.testing.assert_close(out.double(), naive_attention(case, 40), **TOL[torch.float32])


def test_public_function_routes_windows_and_sinks_through_triton(triton_backend) -> None:
    case = _case(SPECS, device=triton_backend, window=17)
    s = _sinks(case.q.shape[1], triton_backend)
    out = kernels.paged_attention(*case.args(), sliding_window=17, sinks=s)
    torch.testing.assert_close(out.double(), naive_attention(case, 17, s), **TOL[torch.float32])
