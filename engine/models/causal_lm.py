"""The causal-LM shell every family shares: embedding, decoder layers, final norm, head, RoPE table.

Orca's selective batching: every token of the step (prefill chunks and decodes alike) goes through
the dense layers as one `[num_tokens, hidden]` matrix; only attention looks at sequences, through
`AttentionMetadata` and the paged KV cache. q/k/v and gate/up projections are fused into one
matmul each (the loader stacks the checkpoint's separate tensors, engine/models/weights.py).

A family (engine/models/<family>.py) subclasses `CausalLM` and says what differs: `make_mlp`
(dense, or a mixture of experts, per layer), `make_layer` (its decoder layer), `hf_renames` (its
checkpoint's module names) and `hf_ignored` (tensors it does not load).
Tensor parallelism: with a `shard`, the model holds only that rank's share (engine/tp/shard.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.kv_groups.spec import KVGroups
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderLayer
from engine.models.embedding import VocabParallelEmbedding
from engine.models.linear import Linear, PACKABLE, onednn_linear, onednn_linear_available
from engine.models.mlp import MLP
from engine.models.norm import RMSNorm
from engine.rope import cos_sin_cache


class CausalLM(nn.Module):
    # (regex, replacement) applied in order to each checkpoint tensor name (after "model." is
    # stripped) before the shared mapping of engine/models/weights.py; a family's own spellings.
    hf_renames: tuple[tuple[str, str], ...] = ()
    # Regexes (matched after "model." is stripped): checkpoint tensors this family does not load
    # (Gemma 3's vision tower in a multimodal checkpoint).
    hf_ignored: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 max_position: int | None = None, shard=None, comm=None) -> None:
        """`shard` (`engine.tp.shard.TPShard`, with `comm` its collectives): build only that
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
        self.layers = nn.ModuleList(self.make_layer(cfg, i, dtype, device, self.comm) for i in range(cfg.num_layers))
        self.use_kv_groups(KVGroups.single(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, vocab_rows, bias=False, dtype=dtype, device=device)
        rope = cos_sin_cache(cfg.rope, cfg.head_dim, max_position or cfg.max_position_embeddings, device)
        self.register_buffer("rope_cache", rope, persistent=False)  # [max_position, head_dim] fp32
        self.requires_grad_(False)

    def checkpoint_tensors(self, f) -> Iterator[tuple[str, torch.Tensor | None]]:
        """`(name, tensor)` for each tensor of the open safetensors file `f`: None to read it from
        the file as it is (the default, every tensor); a family whose checkpoint stores some in
        another layout (gpt-oss: transposed, interleaved or MXFP4 experts) yields them converted."""
        for name in f.keys():
            yield name, None

    def make_layer(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device,
                   comm) -> nn.Module:
        """Decoder layer `layer` (`cfg`: this rank's config). Default: the pre-norm `DecoderLayer`
        over `make_mlp`'s feed-forward block."""
        return DecoderLayer(cfg, self.make_mlp(cfg, layer, dtype, device, comm), dtype, device, comm, layer)

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device,
                 comm) -> nn.Module:
        """The feed-forward block of decoder layer `layer` (`cfg`: this rank's config). Default:
        the dense SwiGLU MLP."""
        return MLP(cfg.hidden_size, cfg.intermediate_size, dtype, device, comm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [num_blocks, num_layers, 2, block_size, KVH, D]
        (with KV groups `[num_blocks, slots, ...]`, `use_kv_groups`).

        Returns the final hidden states `[T, hidden]` (normed)."""
        x = self.embed_tokens(input_ids)                           # [T, hidden]
        residual = None
        metas = (meta, *meta.group_metas)
        for layer, (group, slot) in zip(self.layers, self.kv_place):
            x, residual = layer(x, residual, positions, self.rope_cache, kv_cache[:, slot, 0], kv_cache[:, slot, 1],
                                metas[group])
        x, _ = self.norm(x, residual)
        return x

    def use_kv_groups(self, groups: KVGroups) -> None:
        """Read each layer's KV at its group's slot through its group's tables (`engine.kv_groups`);
        call before the first forward over a cache of that layout."""
        self.kv_groups = groups
        self.kv_place = groups.placement(len(self.layers))

    def pack_weights(self) -> int:
        """CPU: move every projection (lm_head and experts included) onto oneDNN packed weights;
        call once, after the weights are loaded. Returns how many modules were packed (0 off CPU
        / without oneDNN)."""
        return sum(m.pack() for m in self.modules() if m is not self and callable(getattr(m, "pack", None)))

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
            if weight.device.type == "cpu" and weight.dtype in PACKABLE and onednn_linear_available(weight.dtype):
                logits = onednn_linear(hidden, weight, None)  # oneDNN also runs plain [out, in] weights
            else:
                logits = F.linear(hidden, weight)
        if out is not None:
            return out.copy_(logits)
        return logits
