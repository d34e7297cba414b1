"""The model runner's per-step tensors and the CPU oneDNN linear path, on the tiny preset."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import allocate_kv_cache
from engine.loader import load_model
from engine.model import Linear, onednn_linear_available
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.presets import resolve_model_dir
from engine.scheduler import ScheduledSeq

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
    input_ids, positions, meta, logits_indices = runner.prepare(batch)
    ids, pos, slots, rows = _expected(batch)
    assert input_ids.tolist() == ids and positions.tolist() == pos
    assert meta.slot_mapping.tolist() == slots and logits_indices.tolist() == rows
    assert meta.query_start_loc.tolist() == [0, 1, 7, 10, 11] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [10, 8, 3, 1] and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == [[3, 8, 5], [9, 2, 0], [6, 0, 0], [1, 0, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (6, 10)
    # Decode-only steps take the shortcut; the answer must not change.
    decodes = [batch[0], batch[3]]
    _, positions, meta, logits_indices = runner.prepare(decodes)
    assert positions.tolist() == [9, 0] and meta.slot_mapping.tolist() == [21, 4]
    assert logits_indices.tolist() == [0, 1]


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
    input_ids, positions, meta, rows = runner.prepare(batch)
    kv = allocate_kv_cache(cfg, 12, BLOCK, torch.float32, CPU)
    with torch.inference_mode():
        want = plain.compute_logits(plain(input_ids, positions, kv, meta)[rows])
    assert got.shape == (3, cfg.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not onednn_linear_available(), reason="torch without oneDNN")
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


@pytest.mark.skipif(not onednn_linear_available(), reason="torch without oneDNN")
def test_bf16_linear_prefill_rows_take_the_fp32_path():
    from engine.model import BF16_UPCAST_ROWS

    torch.manual_seed(0)
    layer = Linear(32, 48, bias=True, dtype=torch.bfloat16)
    x = torch.randn(BF16_UPCAST_ROWS, 32, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    layer.pack()
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.to(torch.bfloat16))  # one fp32 matmul, rounded once
