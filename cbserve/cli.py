"""The `cbserve` command. Each subcommand parses flags and hands over to its component.

`generate` prints only the generated text on stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys

from cbserve.arg_types import gpu_memory_utilization, positive_int
from cbserve.lora_flags import add_lora_flags, lora_config_from_args
from engine.config import DEFAULT_GPU_MEMORY_UTILIZATION, KV_CACHE_DTYPES, KV_CACHE_GROUPS, QUANTIZATIONS
from engine.spec_decode.config import speculative_config_arg


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset name (tiny, small) or a local HF directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="int8: W8A8 linears (per-channel weights, per-token activations), CPU only; fp8: e4m3 "
                        "linears (per-channel weights, per-token activations; torch._scaled_mm on GPUs of compute "
                        "capability >= 8.9, a dequantizing reference elsewhere). Checkpoints stored in FP8 imply fp8")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="auto: the model dtype; fp8: e4m3 with per-layer static scales (the checkpoint's "
                        "k_scale/v_scale, else 1.0): twice the tokens of bf16 in the same memory")
    p.add_argument("--kv-cache-groups", choices=KV_CACHE_GROUPS, default="auto",
                   help="auto: a model mixing local and global layers (Gemma 3, gpt-oss) keeps a block table per "
                        "window class and frees the local layers' KV behind the window (not while speculating); "
                        "single: one table, every layer's KV kept, as a speculating pod runs: give it to prefill "
                        "pods whose decode pods speculate (the pods of a pull must run the same groups)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                   help="split the model over N ranks (one process and one device each; NCCL on CUDA, "
                        "Gloo on CPU); on CUDA the ranks take N consecutive GPUs from --device")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides the sizes below)")
    p.add_argument("--kv-cache-memory-mb", type=int, default=None,
                   help="KV cache size in MiB (default: from --gpu-memory-utilization on CUDA, 256 on CPU)")
    p.add_argument("--gpu-memory-utilization", type=gpu_memory_utilization, default=None, metavar="FRACTION",
                   help="share of the device's total memory this engine may use (weights, activations, KV "
                        f"cache) when no KV size is given; CUDA only (default {DEFAULT_GPU_MEMORY_UTILIZATION})")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: decode steps launch their kernels one by one (debugging, profiling)")
    p.add_argument("--speculative-config", type=speculative_config_arg, default=None, metavar="JSON",
                   help='speculative decoding (vLLM\'s keys): \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' or \'{"method": "draft_model", '
                        '"model": PATH, "num_speculative_tokens": 4}\' (or "method": "eagle" with an EAGLE-1 head\'s '
                        'directory as model); decode steps verify the drafts, and the '
                        'engine speculates only where its measured step times say it pays. A prefill pod given '
                        'a draft model prefills the draft too and ships its KV with the target\'s (a decode pod '
                        'with the same draft skips its own draft prefill); it ignores the other methods')
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="plan each step only after the previous one's tokens are read back (on CUDA the "
                        "default overlaps them; CPU engines never overlap)")
    add_lora_flags(p)


def engine_config_from_args(args: argparse.Namespace, role: str):
    from engine.config import CacheConfig, SchedulerConfig
    from engine.engine import EngineConfig

    kv_mb = args.kv_cache_memory_mb
    return EngineConfig(
        model=args.model, role=role, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        quantization=args.quantization, enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        async_scheduling=False if args.no_async_scheduling else None,
        speculative=args.speculative_config,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          kv_cache_memory_bytes=None if kv_mb is None else kv_mb << 20,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=not args.no_prefix_caching,
                          kv_cache_dtype=args.kv_cache_dtype, kv_cache_groups=args.kv_cache_groups),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, policy=args.policy),
        lora=lora_config_from_args(args),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.engine import Engine, EngineRequestError
    from engine.sampling.params import SamplingParams, SamplingParamsError

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens)
    except SamplingParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from engine.spec_decode.config import SpeculativeConfigError
    from engine.lora.errors import LoRAError
    from engine.tp.shard import TensorParallelError

    try:
        engine = Engine(engine_config_from_args(args, "colocated"))
    except (TensorParallelError, SpeculativeConfigError, LoRAError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        (out,) = engine.generate([args.prompt], params, lora=args.lora_name)
    except (EngineRequestError, LoRAError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        engine.close()
    sys.stdout.write(out.text)
    sys.stdout.write("\n")
    return 0


def _add_pod_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--engine-core-fd", type=int, default=-1,   # the engine-core process's socket (pod/core.py)
                   help=argparse.SUPPRESS)
    _add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=default_port)
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0 = off)")
    p.add_argument("--pod-id", default="")
    p.add_argument("--kv-transport", choices=["grpc", "nccl"], default="grpc")
    p.add_argument("--kv-store-port", type=int, default=0, help="TCPStore port for --kv-transport nccl")
    p.add_argument("--kv-ttl-seconds", type=float, default=30.0)
    p.add_argument("--drain-seconds", type=float, default=30.0)
    p.add_argument("--advertise-address", default="", metavar="HOST:PORT[,...]",
                   help="addresses the router dials this pod at, which KV handles name, besides "
                        "$CBSERVE_POD_IP:--port (or --host:--port)")
    p.add_argument("--health-port", type=int, default=0,
                   help="also serve grpc.health.v1 on this plaintext port (for probes when serving TLS)")
    from pod.security import add_security_flags
    add_security_flags(p, pod=True)
    p.add_argument("--stall-seconds", type=float, default=10.0,
                   help="report not ready while the engine makes no step for this long (raised to 10x the "
                        "longest recent step)")


def _set_threads() -> None:
    import os

    import torch

    threads = os.environ.get("CBSERVE_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


def cmd_pod(args: argparse.Namespace) -> int:
    import asyncio

    from pod.runtime import PodConfig, PodRuntime
    from pod.security import advertise_address, security_from_args

    role = "prefill" if args.command == "prefill" else ("colocated" if args.colocated else "decode")
    try:
        security = security_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if role == "prefill" and security.secret and not (args.advertise_address
                                                       or advertise_address(args.host, args.port)):
        print(f"error: a prefill pod bound to {args.host} checks KV handles against the address the router "
              "dials it at: pass --advertise-address HOST:PORT or set $CBSERVE_POD_IP", file=sys.stderr)
        return 2
    _set_threads()
    pod = PodConfig(security=security, advertise_address=args.advertise_address, health_port=args.health_port,
                    host=args.host, port=args.port, metrics_port=args.metrics_port, pod_id=args.pod_id,
                    drain_seconds=args.drain_seconds, kv_transport=args.kv_transport,
                    kv_store_port=args.kv_store_port, kv_ttl_seconds=args.kv_ttl_seconds,
                    local_prefill_fallback=not getattr(args, "no_local_prefill_fallback", False),
                    stall_seconds=args.stall_seconds)
    engine_role = "prefill" if role == "prefill" else "decode"
    from engine.lora.errors import LoRAError
    from engine.tp.shard import TensorParallelError

    try:
        engine_config = engine_config_from_args(args, engine_role)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.engine_core_fd < 0:
        # A pod's engine runs in an engine-core process started with this command line
        # (pod/core.py); this process serves gRPC.
        from pod.core_client import CoreRuntime, EngineCoreExited
        if role == "prefill":
            from prefill_pod.server import serve
        else:
            from decode_pod.server import serve
        try:
            return asyncio.run(serve(CoreRuntime(engine_config, pod, role, args.argv)))
        except TensorParallelError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except EngineCoreExited as e:   # it said why on stderr
            return e.code
    from engine.spec_decode.config import SpeculativeConfigError
    try:
        runtime = PodRuntime(engine_config, pod, role)
    except (TensorParallelError, SpeculativeConfigError, LoRAError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from pod.core import run_core
    if role == "prefill":
        from prefill_pod.core import PrefillCore
        return run_core(PrefillCore, runtime, args.engine_core_fd)
    from decode_pod.core import DecodeCore
    return run_core(DecodeCore, runtime, args.engine_core_fd)


def cmd_router(args: argparse.Namespace) -> int:
    from router.app import run
    from router.flags import router_config_from_args

    try:
        config = router_config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run(config)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation for one prompt")
    _add_engine_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--lora-name", default=None, metavar="NAME",
                     help="apply this adapter of --lora-modules (default: the base model)")
    gen.set_defaults(func=cmd_generate)

    pre = sub.add_parser("prefill", help="run a prefill pod (gRPC PrefillService)")
    _add_pod_flags(pre, 50051)
    pre.set_defaults(func=cmd_pod)

    dec = sub.add_parser("decode", help="run a decode pod (gRPC DecodeService)")
    _add_pod_flags(dec, 50052)
    dec.add_argument("--no-local-prefill-fallback", action="store_true",
                     help="fail a request whose prefill pod is lost instead of prefilling it here")
    dec.add_argument("--colocated", action="store_true",
                     help="label this pod a colocated engine (it prefills every request itself)")
    dec.set_defaults(func=cmd_pod)

    rtr = sub.add_parser("router", help="run the OpenAI-compatible router (HTTP)")
    from router.flags import add_router_arguments
    add_router_arguments(rtr)
    rtr.set_defaults(func=cmd_router)

    from cbserve.up import add_up_command  # `cbserve up`: cbserve/up.py
    add_up_command(sub)
    from cbserve.control import add_scale_command  # `cbserve scale`: cbserve/control.py
    add_scale_command(sub)
    from cbserve.planner.cli import add_planner_commands  # `cbserve profile|plan`: cbserve/planner/
    add_planner_commands(sub, _add_engine_flags, engine_config_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    from cbserve.early_listen import bind_for_up
    bind_for_up(list(sys.argv[1:] if argv is None else argv))   # before the imports build_parser makes
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # a decode pod's engine core gets it too
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):  # one line per readiness probe otherwise
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
