"""The decoder models, one file per family over shared layers (vLLM's `model_executor/models/` seam).

Shared layers: `linear` (oneDNN-packed linears on CPU), `norm`, `attention` (optional q/k norm,
per-layer sliding window, sinks), `mlp` (SwiGLU or GeGLU), `moe` (router, experts through
`kernels.fused_moe`, shared expert, gpt-oss's biases), `embedding` (vocab-parallel), `decoder`
(one pre-norm layer), `causal_lm` (the shell: embedding, layers, head, RoPE table), `weights`
(checkpoint names -> our fused parameters), `mxfp4` (MXFP4 weights dequantized at load).
Families: `llama` (Llama, Mistral, Qwen2), `qwen3`, `mixtral`, `qwen2_moe`, `qwen3_moe`,
`gemma3`, `gpt_oss`. `registry` maps a config.json to its family. Nothing is imported here, so the torch-free config code can read the registry.
"""
