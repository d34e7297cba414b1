"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over the flattened tokens of a whole step.

Orca's selective batching: every token of the step (prefill chunks and decodes alike) goes through
the dense layers as one `[num_tokens, hidden]` matrix; only attention looks at sequences, through
`AttentionMetadata` and the paged KV cache. q/k/v and gate/up projections are fused into one
matmul each (the loader stacks the checkpoint's separate tensors).

On CPU, `pack_weights()` (the runner calls it once, after loading) moves every projection onto
oneDNN: each weight is reordered once into oneDNN's blocked layout, replacing the plain copy
(memory-neutral), and the matmuls run oneDNN's brgemm kernels. For the small row counts of
decode steps this is ~1.3-2x faster than `F.linear` (MKL) in fp32, and in bf16 it is the path
that uses avx512_bf16 on half the weight bytes (see bench/step_time.py); bf16 prefill-sized
matmuls run in fp32 instead (`BF16_UPCAST_ROWS`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.rope import cos_sin_cache


# Rows the packed layout is tuned for (oneDNN's hint); any row count runs on it.
PACK_BATCH_HINT = 8
# Without AMX, oneDNN's bf16 matmul is ~1.7x slower than fp32 once it is compute-bound; from this
# many rows on, a bf16 layer unpacks its weight to fp32 for the call (costs one weight pass).
BF16_UPCAST_ROWS = 256
_PACKABLE = (torch.float32, torch.bfloat16)


def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch has oneDNN (mkldnn) and its prepacked linear ops for `dtype` (bf16
    needs a CPU with avx512 or avx_ne_convert: oneDNN refuses to pack it elsewhere)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype != torch.bfloat16 or _onednn_bf16_supported()


@functools.cache
def _onednn_bf16_supported() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # x: [T, in]; weight: [out, in], plain or oneDNN-packed -> [T, out]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class Linear(nn.Linear):
    """`nn.Linear` that can swap its weight for a oneDNN-packed copy (`pack`), CPU only."""

    def pack(self) -> bool:
        """Reorder the weight into oneDNN's layout, in place of the plain one; False if not done.

        Afterwards `weight` is a non-persistent buffer holding an opaque (`is_mkldnn`) tensor of
        the same shape and dtype: it is no longer a parameter, so load weights before packing."""
        weight = self.weight
        if weight.is_mkldnn:
            return True
        if weight.device.type != "cpu" or weight.dtype not in _PACKABLE or not onednn_linear_available(weight.dtype):
            return False
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        del self.weight
        self.register_buffer("weight", packed, persistent=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not weight.is_mkldnn:
            return F.linear(x, weight, self.bias)
        if weight.dtype == torch.bfloat16 and x.shape[0] >= BF16_UPCAST_ROWS:  # prefill-sized
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), weight.to_dense().float(), bias).to(x.dtype)
        return _onednn_linear(x, weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps), x
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, comm=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.comm = comm   # tensor parallel: o_proj is row-parallel, its partial sums all-reduce
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias,
                               dtype=dtype, device=device)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype, device=device)
        self.scale = cfg.head_dim ** -0.5
        # (k_scale, v_scale) of an fp8 KV cache (engine/kv_dtype.py): static, from the checkpoint or 1.0.
        self.kv_scales = (1.0, 1.0)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope_cache: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.cfg
        qkv = self.qkv_proj(x)                                     # [T, q + 2 kv]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)                # [T, H, D]
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)             # [T, KVH, D]
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        k_scale, v_scale = self.kv_scales
        q, k = kernels.rope_and_write_kv(q, k, v, positions, rope_cache, key_cache, value_cache,
                                         meta.slot_mapping, k_scale, v_scale)   # one launch on CUDA
        out = kernels.paged_attention(q, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                      meta.query_start_loc, self.scale, k_scale, v_scale)  # [T, H, D]
        out = self.o_proj(out.reshape(-1, cfg.q_size))                # [T, hidden]
        return out if self.comm is None else self.comm.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, comm=None) -> None:
        super().__init__()
        self.comm = comm   # tensor parallel: down_proj is row-parallel
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False,
                                   dtype=dtype, device=device)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))   # [T, 2I] -> [T, I] -> [T, hidden]
        return out if self.comm is None else self.comm.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, comm=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, dtype, device, comm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device, comm)


class VocabParallelEmbedding(nn.Module):
    """Rank's rows `[start, start + rows)` of the embedding; a token outside them looks up zeros,
    and one all-reduce sums the ranks' rows into the full lookup."""

    def __init__(self, start: int, rows: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 comm) -> None:
        super().__init__()
        self.start, self.rows, self.comm = start, rows, comm
        self.weight = nn.Parameter(torch.zeros(rows, hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start                              # [T]
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.comm.all_reduce(x.masked_fill_(outside[:, None], 0))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 max_position: int | None = None, shard=None, comm=None) -> None:
        """`shard` (`engine.tp_shard.TPShard`, with `comm` its collectives): build only that
        tensor-parallel rank's share; `cfg` is the global config, `self.cfg` the rank's."""
        super().__init__()
        self.comm = comm if shard is not None and shard.size > 1 else None
        vocab_rows = cfg.vocab_size
        if self.comm is not None:
            cfg, vocab_rows = shard.local_config(), shard.vocab_per_rank
            self.embed_tokens = VocabParallelEmbedding(shard.vocab.start, vocab_rows, cfg.hidden_size, dtype,
                                                       device, self.comm)
        else:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device, self.comm) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, vocab_rows, bias=False, dtype=dtype, device=device)
        rope = cos_sin_cache(cfg.rope, cfg.head_dim, max_position or cfg.max_position_embeddings, device)
        self.register_buffer("rope_cache", rope, persistent=False)  # [max_position, head_dim] fp32
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [num_blocks, num_layers, 2, block_size, KVH, D].

        Returns the final hidden states `[T, hidden]` (normed)."""
        x = self.embed_tokens(input_ids)                           # [T, hidden]
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer.input_layernorm(x, residual)
            x = layer.self_attn(h, positions, self.rope_cache, kv_cache[:, i, 0], kv_cache[:, i, 1], meta)
            h, residual = layer.post_attention_layernorm(x, residual)
            x = layer.mlp(h)
        x, _ = self.norm(x, residual)
        return x

    def pack_weights(self) -> int:
        """CPU: move every projection (lm_head included) onto oneDNN packed weights; call once,
        after the weights are loaded. Returns how many were packed (0 off CPU / without oneDNN)."""
        return sum(m.pack() for m in self.modules() if isinstance(m, Linear))

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in the model dtype (the sampler upcasts).

        Only the rows that sample come here: the runner selects them before the vocab matmul.
        `out` ([N, vocab], contiguous): write the logits there (CUDA graphs keep one buffer).
        Tensor parallel: every rank computes its vocab shard and all of them get the full logits
        (one all-gather); every rank must call this with the same number of rows."""
        if self.comm is None:
            return self._shard_logits(hidden, out)
        if hidden.shape[0] == 0:    # every rank sees the same count: all skip the collective
            logits = hidden.new_empty((0, self.cfg.vocab_size))
        else:
            local = self._shard_logits(hidden, None)                               # [N, vocab_per_rank]
            logits = self.comm.all_gather_columns(local)[:, :self.cfg.vocab_size]  # [N, vocab]
        return logits if out is None else out.copy_(logits)

    def _shard_logits(self, hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        # The head over this model's vocab rows (all of them without tensor parallelism).
        if out is not None and (self.lm_head is None or not self.lm_head.weight.is_mkldnn) \
                and (self.lm_head is None or self.lm_head.bias is None):
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            return torch.mm(hidden, weight.t(), out=out)
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            weight = self.embed_tokens.weight  # tied: the embedding stays plain for the lookup
            if weight.device.type == "cpu" and weight.dtype in _PACKABLE and onednn_linear_available(weight.dtype):
                logits = _onednn_linear(hidden, weight, None)  # oneDNN also runs plain [out, in] weights
            else:
                logits = F.linear(hidden, weight)
        if out is not None:
            return out.copy_(logits)
        return logits
