"""Compile every Triton kernel for a CUDA target (sm_90) without a GPU (run by test_compile_gpu.py).

The interpreter accepts code the GPU compiler rejects (tl.dot shapes, loop-carried types,
constexpr specialisation of arguments equal to 1), so each kernel is also compiled ahead of time
through Triton's NVIDIA backend down to a cubin, with the argument specialisations a real launch
produces (unit strides and ``num_seqs == 1`` become constants). Skipped when the backend or its
bundled ptxas is missing.
"""

from __future__ import annotations

import sys


class MissingToolchain(Exception):
    """The NVIDIA backend cannot assemble (no ptxas): nothing to check on this machine."""


# An H100/H200 block may use at most 227 KB of shared memory; a launch asking for more fails.
MAX_SHARED_BYTES = 227 * 1024


# Strides that are not multiples of 16 in a typical launch (a block table's width is arbitrary).
UNALIGNED = {"stride_bt"}


def _compile(jit, pointers: dict[str, str], constants: dict[str, object], scalars: dict[str, str] = {},
             num_warps: int = 4):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = jit.arg_names
    signature = {n: pointers.get(n) or ("constexpr" if n in constants else scalars.get(n, "i32")) for n in names}
    # A launch marks 16-byte-aligned pointers and ints divisible by 16 (tt.divisibility): with them
    # the loads vectorise and the attention loops are software-pipelined (cp.async stages), which
    # is what sizes the shared memory checked below. Typical launches have such strides.
    divisible = [n for n in names if n in pointers or (n.startswith("stride_") and n not in constants
                                                       and n not in UNALIGNED)]
    source = ASTSource(fn=jit, signature=signature,
                       constexprs={(names.index(n),): v for n, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except RuntimeError as err:
        if "ptxas" in str(err).lower() and "not found" in str(err).lower():
            raise MissingToolchain(str(err)) from err
        raise
    assert compiled.asm["cubin"]
    shared = compiled.metadata.shared
    assert shared <= MAX_SHARED_BYTES, f"{jit.__name__} {constants}: {shared} bytes of shared memory"


def _attention_pointers(dtype: str) -> dict[str, str]:
    return {"out_ptr": dtype, "q_ptr": dtype, "k_cache_ptr": dtype, "v_cache_ptr": dtype,
            "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "sinks_ptr": "*fp32"}


UNIFIED_CONFIGS = [
        # mixed prefill+decode on a GPU: 128-row tiles (32 tokens x GQA 4) on 8 warps plus the decode
        # programs, bf16, head_dim 128 (launch_unified's defaults when the batch holds prefill tokens)
        ("*bf16", dict(HEAD_DIM=128, HEAD_PAD=128, GROUP=4, GROUP_PAD=4, BLOCK_Q=32, BLOCK_N=64, BLOCK_SIZE=16,
                       IEEE_FP32=False, HAS_SINKS=False, SPLIT_DECODES=True, DECODE_ROWS=16), 8),
        # prefill-sized tiles without split decodes, bf16, GQA 8
        ("*bf16", dict(HEAD_DIM=128, HEAD_PAD=128, GROUP=8, GROUP_PAD=8, BLOCK_Q=8, BLOCK_N=64, BLOCK_SIZE=16,
                       IEEE_FP32=False, HAS_SINKS=False, SPLIT_DECODES=False, DECODE_ROWS=16), 4),
        # decode-sized tiles, fp32 with ieee dots, head_dim 80 padded, one sequence (num_seqs == 1)
        ("*fp32", dict(HEAD_DIM=80, HEAD_PAD=128, GROUP=1, GROUP_PAD=1, BLOCK_Q=16, BLOCK_N=32, BLOCK_SIZE=1,
                       IEEE_FP32=True, HAS_SINKS=False, SPLIT_DECODES=False, DECODE_ROWS=16, num_seqs=1), 4),
        # fp16 mixed batch of one sequence with GQA 3 (padded group) and head_dim 80
        ("*fp16", dict(HEAD_DIM=80, HEAD_PAD=128, GROUP=3, GROUP_PAD=4, BLOCK_Q=32, BLOCK_N=64, BLOCK_SIZE=16,
                       IEEE_FP32=False, HAS_SINKS=False, SPLIT_DECODES=True, DECODE_ROWS=16, num_seqs=1), 8),
        # gpt-oss: sinks, head_dim 64, GQA 8, bf16 mixed batch (its sliding layers: a runtime window)
        ("*bf16", dict(HEAD_DIM=64, HEAD_PAD=64, GROUP=8, GROUP_PAD=8, BLOCK_Q=16, BLOCK_N=64, BLOCK_SIZE=16,
                       IEEE_FP32=False, HAS_SINKS=True, SPLIT_DECODES=True, DECODE_ROWS=16), 8),
]


def unified_attention() -> None:
    from kernels.attention_triton import _unified_attention_kernel

    scalars = {"scale": "fp32", "v_scale": "fp32"}
    for dtype, constants, num_warps in UNIFIED_CONFIGS:
        _compile(_unified_attention_kernel, _attention_pointers(dtype),
                 dict(constants, stride_qd=1, stride_od=1, stride_kd=1, stride_vd=1), scalars, num_warps=num_warps)
    # An fp8 (e4m3) KV cache under bf16 queries: tiles upcast on load (--kv-cache-dtype fp8).
    for _, constants, num_warps in UNIFIED_CONFIGS[:2]:
        pointers = dict(_attention_pointers("*bf16"), k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
        _compile(_unified_attention_kernel, pointers,
                 dict(constants, stride_qd=1, stride_od=1, stride_kd=1, stride_vd=1), scalars, num_warps=num_warps)


def split_k() -> None:
    from kernels.attention_splitk_triton import _split_k_partial_kernel, _split_k_reduce_kernel

    for kv_dtype in ("*fp16", "*fp8e4nv"):   # the model dtype, and an fp8 (e4m3) KV cache
        pointers = _attention_pointers("*fp16")
        pointers.update(part_out_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", k_cache_ptr=kv_dtype,
                        v_cache_ptr=kv_dtype)
        del pointers["out_ptr"]
        del pointers["sinks_ptr"]
        _compile(_split_k_partial_kernel, pointers,
                 dict(HEAD_DIM=128, HEAD_PAD=128, GROUP=8, ROWS=16, BLOCK_N=64, BLOCK_SIZE=16, PARTITION_SIZE=512,
                      IEEE_FP32=False, stride_qd=1, stride_kd=1, stride_vd=1), {"scale": "fp32"})
    for sinks in (False, True):
        _compile(_split_k_reduce_kernel,
                 {"out_ptr": "*fp16", "part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                  "query_start_loc_ptr": "*i32", "sinks_ptr": "*fp32"},
                 dict(HEAD_DIM=128, HEAD_PAD=128, PARTS_PAD=8, stride_od=1, HAS_SINKS=sinks), {"v_scale": "fp32"})


def elementwise() -> None:
    from kernels.kv_write_triton import _write_kv_kernel
    from kernels.norm_triton import _rms_norm_kernel
    from kernels.activation_triton import _gated_act_kernel
    from kernels.rope_kv_triton import _rope_kv_kernel
    from kernels.rope_triton import _rope_kernel

    inv_scales = {"k_inv_scale": "fp32", "v_inv_scale": "fp32"}
    for cache in ("*bf16", "*fp8e4nv"):   # the model dtype, and an fp8 (e4m3) KV cache: quantizing stores
        _compile(_write_kv_kernel,
                 {"key_ptr": "*bf16", "value_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache,
                  "slot_mapping_ptr": "*i64"},
                 dict(HEAD_DIM=80, HEADS_PAD=8, HEAD_PAD=128, BLOCK_SIZE=16, stride_kd=1, stride_vd=1,
                      stride_ckd=1, stride_cvd=1, FP8=cache == "*fp8e4nv"),
                 {"stride_ckb": "i64", "stride_cvb": "i64", **inv_scales})
    _compile(_rms_norm_kernel,
             {"out_ptr": "*bf16", "sum_ptr": "*bf16", "x_ptr": "*bf16", "residual_ptr": "*bf16",
              "weight_ptr": "*bf16"},
             dict(BLOCK=4096, HAS_RESIDUAL=True), {"eps": "fp32"})
    _compile(_rope_kernel,
             {"q_out_ptr": "*bf16", "k_out_ptr": "*bf16", "q_ptr": "*bf16", "k_ptr": "*bf16",
              "positions_ptr": "*i64", "cos_sin_ptr": "*fp32"},
             dict(HALF=64, HALF_PAD=64, Q_HEADS_PAD=32, K_HEADS_PAD=8))
    rope_kv_pointers = {"q_out_ptr": "*bf16", "k_out_ptr": "*bf16", "q_ptr": "*bf16", "k_ptr": "*bf16",
                        "v_ptr": "*bf16", "positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "k_cache_ptr": "*bf16",
                        "v_cache_ptr": "*bf16", "slot_mapping_ptr": "*i64"}
    cache_strides = {"stride_ckb": "i64", "stride_cvb": "i64", **inv_scales}
    # Full rotary (Llama) and partial rotary with an odd-sized tail (the in-kernel tail copy).
    _compile(_rope_kv_kernel, rope_kv_pointers,
             dict(HALF=64, HALF_PAD=64, TAIL=0, TAIL_PAD=1, HEAD_DIM=128, HEAD_PAD=128, Q_HEADS_PAD=32,
                  K_HEADS_PAD=8, BLOCK_SIZE=16, FP8=False), cache_strides)
    _compile(_rope_kv_kernel, rope_kv_pointers,
             dict(HALF=32, HALF_PAD=32, TAIL=16, TAIL_PAD=16, HEAD_DIM=80, HEAD_PAD=128, Q_HEADS_PAD=32,
                  K_HEADS_PAD=8, BLOCK_SIZE=16, FP8=False), cache_strides)
    # An fp8 (e4m3) KV cache: rotated k and v quantized as they are stored, partial rotary included.
    fp8_pointers = dict(rope_kv_pointers, k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
    _compile(_rope_kv_kernel, fp8_pointers,
             dict(HALF=32, HALF_PAD=32, TAIL=16, TAIL_PAD=16, HEAD_DIM=80, HEAD_PAD=128, Q_HEADS_PAD=32,
                  K_HEADS_PAD=8, BLOCK_SIZE=16, FP8=True), cache_strides)
    for act in (0, 1):   # SwiGLU, GeGLU (tanh GELU)
        _compile(_gated_act_kernel, {"out_ptr": "*bf16", "x_ptr": "*bf16"}, dict(BLOCK=1024, ACT=act))
    from kernels.fp8_quant_triton import _quantize_rows_kernel
    for static in (False, True):   # fp8 linears' activations: per-token, or the checkpoint's static scale
        _compile(_quantize_rows_kernel,
                 {"out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "x_ptr": "*bf16", "static_scale_ptr": "*fp32"},
                 dict(BLOCK=1024, STATIC=static), {"min_scale": "fp32"})


def fused_moe() -> None:
    from kernels.moe_triton import _moe_gemm_kernel

    def pointers(act: str, weight: str) -> dict[str, str]:
        return {"c_ptr": act, "a_ptr": act, "b_ptr": weight, "b_scale_ptr": "*fp32", "bias_ptr": act,
                "weights_ptr": "*fp32", "sorted_slots_ptr": "*i32", "block_experts_ptr": "*i32",
                "num_padded_ptr": "*i32"}

    # gate/up (SwiGLU epilogue) at decode tiles, down (routing weight) at prefill tiles, fp32 with
    # ieee dots, and fp8 (e4m3) expert weights under bf16 activations.
    for (act, weight), constants in (
            (("*bf16", "*bf16"), dict(A_DIV=8, SWIGLU=True, MUL_WEIGHT=False, HAS_SCALE=False, IEEE_FP32=False,
                                      BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)),
            (("*bf16", "*bf16"), dict(A_DIV=1, SWIGLU=False, MUL_WEIGHT=True, HAS_SCALE=False, IEEE_FP32=False,
                                      BLOCK_M=64, BLOCK_N=64, BLOCK_K=128)),
            (("*fp32", "*fp32"), dict(A_DIV=2, SWIGLU=True, MUL_WEIGHT=False, HAS_SCALE=False, IEEE_FP32=True,
                                      BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)),
            (("*bf16", "*fp8e4nv"), dict(A_DIV=8, SWIGLU=True, MUL_WEIGHT=False, HAS_SCALE=True, IEEE_FP32=False,
                                         BLOCK_M=16, BLOCK_N=64, BLOCK_K=128))):
        _compile(_moe_gemm_kernel, pointers(act, weight), dict(constants, HAS_BIAS=False, OAI=False, stride_bk=1),
                 {"alpha": "fp32", "limit": "fp32"})
    # gpt-oss: per-expert biases, the clamped SwiGLU (gate/up) and the biased down projection, bf16.
    for swiglu in (True, False):
        _compile(_moe_gemm_kernel, pointers("*bf16", "*bf16"),
                 dict(A_DIV=4 if swiglu else 1, SWIGLU=swiglu, MUL_WEIGHT=not swiglu, HAS_SCALE=False, HAS_BIAS=True,
                      OAI=swiglu, IEEE_FP32=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, stride_bk=1),
                 {"alpha": "fp32", "limit": "fp32"})


def main() -> int:
    try:
        for check in (unified_attention, split_k, elementwise, fused_moe):
            check()
            print("compiled", check.__name__, flush=True)
    except MissingToolchain as err:
        print("skip:", err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
