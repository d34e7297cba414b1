"""The decoder models, one file per family over shared layers (vLLM's `model_executor/models/` seam).

Shared layers: `linear` (oneDNN-packed linears on CPU), `norm`, `attention`, `mlp`, `embedding`
(vocab-parallel), `decoder` (one pre-norm layer), `causal_lm` (the shell: embedding, layers, head,
RoPE table), `weights` (checkpoint names -> our fused parameters). Families: `llama` (Llama,
Mistral, Qwen2). `registry` maps a config.json to its family. Nothing is imported here, so the
torch-free config code can read the registry.
"""
