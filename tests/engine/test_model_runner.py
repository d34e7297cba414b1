"""The model runner's per-step tensors and the CPU oneDNN linear path, on the tiny preset."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import allocate_kv_cache
from engine.loader import load_model
from engine.models.linear import Linear, onednn_linear_available
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.presets import resolve_model_dir
from engine.scheduling.scheduler import ScheduledSeq

BLOCK = 4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny():
    path = resolve_model_dir("tiny")
    return path, ModelConfig.from_dir(path)


def _batch() -> list[ScheduledSeq]:
    return [
        ScheduledSeq("decode", (7,), 9, (3, 8, 5), True),                 # position 9: block 5, offset 1
        ScheduledSeq("chunk", (1, 2, 3, 4, 5, 6), 2, (9, 2), False),      # mid-prefill: no sample
        ScheduledSeq("prefill", (11, 12, 13), 0, (6,), True),
        ScheduledSeq("decode2", (4,), 0, (1,), True),
    ]


def _expected(batch: list[ScheduledSeq]):
    """Per-token reference of what `prepare` must produce."""
    ids, positions, slots, logits_rows = [], [], [], []
    for seq in batch:
        for j, tok in enumerate(seq.token_ids):
            pos = seq.start_position + j
            ids.append(tok)
            positions.append(pos)
            slots.append(seq.block_ids[pos // BLOCK] * BLOCK + pos % BLOCK)
        if seq.sample:
            logits_rows.append(len(ids) - 1)
    return ids, positions, slots, logits_rows


def test_prepare_builds_the_step_tensors(tiny):
    path, cfg = tiny
    model = load_model(path, cfg, torch.float32, CPU)
    runner = ModelRunner(model, allocate_kv_cache(cfg, 12, BLOCK, torch.float32, CPU), BLOCK, CPU)
    batch = _batch()
    t = runner.prepare(batch)
    meta = t.meta
    ids, pos, slots, rows = _expected(batch)
    assert t.input_ids.tolist() == ids and t.positions.tolist() == pos
    assert meta.slot_mapping.tolist() == slots and t.logits_indices.tolist() == rows
    assert meta.query_start_loc.tolist() == [0, 1, 7, 10, 11] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [10, 8, 3, 1] and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == [[3, 8, 5], [9, 2, 0], [6, 0, 0], [1, 0, 0]]
    assert t.fill_dst.numel() == 0 and t.num_seqs == 4
    # Decode-only steps take the shortcut; the answer must not change.
    decodes = [batch[0], batch[3]]
    t = runner.prepare(decodes)
    assert t.positions.tolist() == [9, 0] and t.meta.slot_mapping.tolist() == [21, 4]
    assert t.logits_indices.tolist() == [0, 1]


def test_prepare_pads_a_decode_batch_to_its_bucket(tiny):
    """Padding rows are harmless decodes: token 0 at position 0, slot -1 (no KV write), context 1,
    block row 0 (the null block); the table is as wide as asked."""
    path, cfg = tiny
    runner = ModelRunner(load_model(path, cfg, torch.float32, CPU),
                         allocate_kv_cache(cfg, 12, BLOCK, torch.float32, CPU), BLOCK, CPU)
    batch = _batch()
    t = runner.inputs.prepare([batch[0], batch[3]], pad_to=4, width=5)
    assert t.input_ids.tolist() == [7, 4, 0, 0] and t.positions.tolist() == [9, 0, 0, 0]
    assert t.meta.slot_mapping.tolist() == [21, 4, -1, -1]
    assert t.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert t.meta.seq_lens.tolist() == [10, 1, 1, 1]
    assert t.meta.block_tables.tolist() == [[3, 8, 5, 0, 0], [1, 0, 0, 0, 0]] + [[0] * 5] * 2
    assert t.logits_indices.tolist() == [0, 1, 2, 3] and t.num_seqs == 2


def test_prepare_marks_placeholder_tokens_for_the_device_fill(tiny):
    """Async scheduling: a decode whose token is still on the device has PLACEHOLDER_TOKEN_ID;
    prepare names its token row and the row of the previous sample that holds it."""
    from engine.model_runner import PrevSample
    from engine.scheduling.output import PLACEHOLDER_TOKEN_ID

    path, cfg = tiny
    runner = ModelRunner(load_model(path, cfg, torch.float32, CPU),
                         allocate_kv_cache(cfg, 12, BLOCK, torch.float32, CPU), BLOCK, CPU)
    batch = [ScheduledSeq("chunk", (1, 2, 3), 0, (9,), False),
             ScheduledSeq("a", (PLACEHOLDER_TOKEN_ID,), 5, (3, 8), True),
             ScheduledSeq("b", (6,), 2, (4,), True),
             ScheduledSeq("c", (PLACEHOLDER_TOKEN_ID,), 1, (2,), True)]
    prev = PrevSample(torch.tensor([40, 41, 42]), {"c": 0, "x": 1, "a": 2})
    t = runner.prepare(batch, prev)
    assert t.fill_dst.tolist() == [3, 5] and t.fill_src.tolist() == [2, 0]
    # run() fills them on the device: equal to running the batch with the real tokens.
    real = [batch[0], batch[1]._replace(token_ids=(42,)), batch[2], batch[3]._replace(token_ids=(40,))]
    kv_a, kv_b = (allocate_kv_cache(cfg, 12, BLOCK, torch.float32, CPU) for _ in range(2))
    runner.kv_cache = kv_a
    got = runner.run(batch, prev)
    runner.kv_cache = kv_b
    want = runner.run(real)
    assert torch.equal(got, want) and torch.equal(kv_a, kv_b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_decode_step_equals_the_unpadded_one(tiny, dtype):
    """The CUDA-graph path's logic on CPU: a decode batch padded to its bucket (and its block
    table to the bucket's width) gives the same logits and KV as the plain eager step, and hands
    an EAGLE head's sink the same hidden states (the padded path through its graph buffer)."""
    path, cfg = tiny
    blocks = 40
    sunk = {}
    eager = ModelRunner(load_model(path, cfg, dtype, CPU), allocate_kv_cache(cfg, blocks, BLOCK, dtype, CPU),
                        BLOCK, CPU, max_num_seqs=16, max_model_len=64, enforce_eager=True,
                        hidden_sink=lambda seqs, hidden, owned=False: sunk.__setitem__("eager", hidden.clone()))
    padded = ModelRunner(load_model(path, cfg, dtype, CPU), allocate_kv_cache(cfg, blocks, BLOCK, dtype, CPU),
                         BLOCK, CPU, max_num_seqs=16, max_model_len=64, enforce_eager=False,
                         hidden_sink=lambda seqs, hidden, owned=False: sunk.__setitem__("padded", hidden.clone()))
    assert eager.decode_buckets is None and padded.decode_buckets is not None
    g = torch.Generator().manual_seed(0)
    for runner in (eager, padded):   # the same random context in both caches
        runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(1)))
    batch = [ScheduledSeq(f"r{i}", (int(torch.randint(0, cfg.vocab_size, (1,), generator=g)),), start,
                          tuple(range(1 + 3 * i, 1 + 3 * i + start // BLOCK + 1)), True)
             for i, start in enumerate([0, 5, 9, 2, 11])]
    assert padded.decode_buckets.bucket(batch) == 8 and padded.decode_buckets.width == 16   # 5 seqs -> 8; 64 tokens
    got, want = padded.run(batch), eager.run(batch)
    assert got.shape == want.shape == (5, cfg.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-5)
    assert torch.equal(padded.kv_cache, eager.kv_cache)   # padding wrote nothing
    assert sunk["eager"].shape == sunk["padded"].shape == (5, cfg.hidden_size)
    torch.testing.assert_close(sunk["padded"], sunk["eager"], atol=1e-5 if dtype == torch.float32 else 2e-2,
                               rtol=1e-5)


def test_padded_verification_step_equals_the_eager_one(tiny):
    """Speculative verification padded to (bucket, 1 + k) tokens a request (the verification graphs'
    path, `engine.spec_decode.verify_graphs`, on CPU): the same logits rows as the eager step, and
    the same KV: padding tokens write nothing."""
    path, cfg = tiny
    runners = [ModelRunner(load_model(path, cfg, torch.float32, CPU), allocate_kv_cache(cfg, 40, BLOCK, torch.float32, CPU),
                           BLOCK, CPU, max_num_seqs=16, max_model_len=64, enforce_eager=eager, verify=(4, 8))
               for eager in (True, False)]
    eager, padded = runners
    assert eager.verify_buckets is None and padded.verify_buckets.batch_sizes == [1, 2, 4, 8]
    for runner in runners:
        runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(1)))
    g = torch.Generator().manual_seed(0)
    batch = []
    for i, (start, n) in enumerate([(0, 5), (5, 1), (9, 3), (2, 2), (11, 5)]):   # 1 + drafts: 0..4
        tokens = tuple(torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist())
        batch.append(ScheduledSeq(f"r{i}", tokens, start, tuple(range(1 + 5 * i, 1 + 5 * i + (start + n - 1) // BLOCK + 1)), n))
    assert padded.verify_buckets.bucket(batch) == 8 and padded.decode_buckets.bucket(batch) is None
    got, want = padded.run(batch), eager.run(batch)
    assert got.shape == want.shape == (16, cfg.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(padded.kv_cache, eager.kv_cache)   # padding wrote nothing
    full = [seq._replace(token_ids=(3,) * 5) for seq in (batch[0], batch[4])]      # every seq at the width: a view
    torch.testing.assert_close(padded.run(full), eager.run(full), atol=1e-5, rtol=1e-5)
    # A prefill chunk, a plain decode batch, or padding past the context: not a verification bucket.
    assert padded.verify_buckets.bucket([*batch[:2], ScheduledSeq("p", (1, 2, 3), 0, (30,), 1)]) is None
    assert padded.verify_buckets.bucket([seq._replace(token_ids=(1,), sample=1) for seq in batch]) is None
    assert padded.verify_buckets.bucket([batch[0]._replace(start_position=60)]) is None


def test_bucket_tables():
    from engine.cuda_graphs import batch_size_buckets, graph_width, smallest_at_least

    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_size_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_width(64, 4) == 16
    assert graph_width(131072, 16) == 512      # one width for every graph: contexts up to 8192 tokens
    assert graph_width(1000, 16) == 63
    assert smallest_at_least([1, 2, 4], 3) == 4 and smallest_at_least([1, 2, 4], 5) is None


@pytest.mark.skipif(not onednn_linear_available(), reason="torch without oneDNN")
def test_packed_linears_match_plain_ones(tiny):
    path, cfg = tiny
    plain = load_model(path, cfg, torch.float32, CPU)
    packed = load_model(path, cfg, torch.float32, CPU)
    runner = ModelRunner(packed, allocate_kv_cache(cfg, 12, BLOCK, torch.float32, CPU), BLOCK, CPU)
    layer = packed.layers[0].self_attn.qkv_proj
    assert isinstance(layer, Linear) and layer.weight.is_mkldnn
    assert "layers.0.self_attn.qkv_proj.weight" not in dict(packed.named_parameters())
    assert layer.weight.shape == plain.layers[0].self_attn.qkv_proj.weight.shape

    batch = _batch()
    got = runner.run(batch)
    t = runner.prepare(batch)
    kv = allocate_kv_cache(cfg, 12, BLOCK, torch.float32, CPU)
    with torch.inference_mode():
        want = plain.compute_logits(plain(t.input_ids, t.positions, kv, t.meta)[t.logits_indices])
    assert got.shape == (3, cfg.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not onednn_linear_available(torch.bfloat16), reason="no oneDNN bf16 on this CPU")
def test_bf16_linear_packs_and_stays_close():
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True, dtype=torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = layer(x).float()
        assert layer.pack() and layer.weight.is_mkldnn
        got = layer(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_half_precision_linear_is_left_plain():
    layer = Linear(8, 8, dtype=torch.float16)
    assert not layer.pack() and not layer.weight.is_mkldnn


@pytest.mark.skipif(not onednn_linear_available(torch.bfloat16), reason="no oneDNN bf16 on this CPU")
def test_bf16_linear_prefill_rows_take_the_fp32_path():
    from engine.models.linear import BF16_UPCAST_ROWS

    torch.manual_seed(0)
    layer = Linear(32, 48, bias=True, dtype=torch.bfloat16)
    x = torch.randn(BF16_UPCAST_ROWS, 32, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    layer.pack()
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.to(torch.bfloat16))  # one fp32 matmul, rounded once
