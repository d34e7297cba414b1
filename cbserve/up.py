"""`cbserve up`: a local cluster of real processes (router + prefill + decode pods) in one command.

    cbserve up                       # tiny model, 1 prefill + 1 decode, router on :8000
    cbserve up --prefill 2 --decode 2 --model small
    cbserve up --colocated 2         # the aggregated baseline
    cbserve up --demo                # also send one completion and one chat request (`make up`)

It prints the router URL and every pod's address and metrics URL once all are ready, streams their
logs with a `[name]` prefix, and on Ctrl-C / SIGTERM drains the router, then the pods (a second
Ctrl-C kills at once). `cbserve scale --port PORT --decode N` changes the pod counts while it runs
(`cbserve.control`). A process that dies is restarted like a kubelet would (same address,
exponential backoff capped at 30 s; `cbserve.supervisor`) while the others keep serving; with
`--exit-on-failure` it makes `up` stop the rest and exit 1 with its log tail instead.
The Python API is `LocalCluster` (re-exported here).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from cbserve.arg_types import gpu_memory_utilization, positive_int
from cbserve.cluster_spec import KV_TRANSPORTS, POLICIES, ClusterSpec
from cbserve.control import ControlServer, default_socket_path
from cbserve.early_listen import take
from cbserve.local_cluster import ClusterError, LocalCluster, PodInfo
from cbserve.processes import stderr_sink
from engine.config import DEFAULT_GPU_MEMORY_UTILIZATION, KV_CACHE_DTYPES, QUANTIZATIONS
from engine.spec_decode.config import speculative_config_arg
from router.structured.flags import add_up_arguments, up_router_args

__all__ = ["ClusterError", "ClusterSpec", "LocalCluster", "PodInfo", "add_up_command", "cmd_up"]


def add_up_command(sub: argparse._SubParsersAction) -> None:
    """Register `cbserve up` on the CLI's subparsers."""
    p = sub.add_parser("up", help="run router + prefill + decode pods locally", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="preset name (tiny, small) or a local HF directory")
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill pods")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode pods")
    p.add_argument("--colocated", type=int, default=0, metavar="K",
                   help="K colocated engines instead of prefill/decode pods (aggregated baseline)")
    p.add_argument("--host", default="127.0.0.1", help="the router's bind address")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--policy", choices=POLICIES, default="goodput", help="the router's routing policy")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="API key the router requires (visible in `ps`: for development; prefer --api-key-file "
                          "or CBSERVE_API_KEY). Only the router gets it, never a pod")
    key.add_argument("--api-key-file", default=None, help="file holding the router's API key")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--kv-transport", choices=KV_TRANSPORTS, default="grpc")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="int8: W8A8 linears on every pod (CPU only); fp8: e4m3 linears")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="every pod's KV cache dtype (auto: the model's; fp8: e4m3, per-tensor scales)")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                   help="ranks per pod (processes; on CUDA N consecutive GPUs from --device each)")
    p.add_argument("--prefill-tensor-parallel-size", type=positive_int, default=None, metavar="P",
                   help="ranks per prefill pod (default: --tensor-parallel-size); P/D maps any two degrees")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=gpu_memory_utilization, default=None, metavar="FRACTION",
                   help="share of the CUDA device's memory for all the pods on it, split evenly between "
                        f"them (default {DEFAULT_GPU_MEMORY_UTILIZATION}: 0.45 each for 1 prefill + 1 "
                        "decode); pods on one device start one after another, so each measures its own")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs in any pod")
    p.add_argument("--speculative-config", type=speculative_config_arg, default=None, metavar="JSON",
                   help="speculative decoding on the decode (or colocated) pods, vLLM's JSON keys "
                        "(see `cbserve decode --help`); prefill pods need none")
    p.add_argument("--threads-per-pod", type=int, default=None, metavar="N",
                   help="torch/OpenMP threads per process (env CBSERVE_NUM_THREADS)")
    p.add_argument("--startup-timeout", type=float, default=300.0, metavar="SECONDS")
    p.add_argument("--drain-seconds", type=float, default=10.0)
    p.add_argument("--startup-wait-seconds", type=float, default=60.0, metavar="SECONDS",
                   help="a request sent while the pods are still starting (or restarting) waits this long for "
                        "one, then gets 503 with Retry-After (the router's flag)")
    p.add_argument("--log-dir", default=None, help="also write each process's log to DIR/<name>.log")
    from cbserve.lora_flags import add_lora_flags
    add_lora_flags(p)   # passed to every pod; the router gets --enable-lora (and runtime updating)
    add_up_arguments(p)
    p.add_argument("--exit-on-failure", action="store_true",
                   help="stop the whole cluster and exit 1 when a process dies (default: restart it)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="the router serves GET /tokenizer_info (lm-evaluation-harness's remote tokenizer reads it)")
    p.add_argument("--demo", action="store_true",
                   help="once ready, send one completion and one chat request with the openai client")
    p.set_defaults(func=cmd_up)


def api_key_from_args(args: argparse.Namespace) -> str | None:
    """`--api-key`, or the contents of `--api-key-file`, or None (the router reads CBSERVE_API_KEY)."""
    from router.config import read_api_key_file

    return read_api_key_file(args.api_key_file) if args.api_key_file else (args.api_key or None)


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    from cbserve.lora_flags import lora_cluster_args

    lora_pod_args, lora_router_args = lora_cluster_args(args)
    return ClusterSpec(
        model=args.model, num_prefill=args.prefill, num_decode=args.decode, num_colocated=args.colocated,
        host=args.host, port=args.port, policy=args.policy, slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms, kv_transport=args.kv_transport, device=args.device, dtype=args.dtype,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size, prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        speculative_config=None if args.speculative_config is None else args.speculative_config.to_json(),
        threads_per_pod=args.threads_per_pod, startup_timeout=args.startup_timeout,
        drain_seconds=args.drain_seconds, startup_wait_seconds=args.startup_wait_seconds,
        api_key=api_key_from_args(args), pod_args=tuple(lora_pod_args),
        router_args=up_router_args(args) + tuple(lora_router_args)
        + (("--enable-tokenizer-info-endpoint",) if args.enable_tokenizer_info_endpoint else ()))


def describe(cluster: LocalCluster) -> str:
    """The ready banner: router URL, every pod's address and metrics URL, and a first request."""
    spec = cluster.spec
    layout = (f"{spec.num_colocated} colocated" if spec.colocated
              else f"{spec.num_prefill} prefill + {spec.num_decode} decode")
    rows = [("router", cluster.base_url, cluster.metrics_url)]
    rows += [(pod.name, pod.address, pod.metrics_url) for pod in cluster.pods]
    width = max(len(name) for name, _, _ in rows)
    lines = [f"cbserve is ready: model {spec.model}, {layout}, policy {spec.policy}"]
    lines += [f"  {name:<{width}}  {address:<28}  metrics {metrics}" for name, address, metrics in rows]
    lines += ["", "Try:",
              f"  curl {cluster.base_url}/completions -H 'Content-Type: application/json' \\",
              f"    -d '{{\"model\": \"{spec.model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'",
              "Press Ctrl-C to stop."]
    return "\n".join(lines)


def run_demo(cluster: LocalCluster) -> None:
    """One completion and one chat request through the router with the real `openai` client."""
    import openai

    # Retries honour the router's Retry-After on a 429 (a busy machine can make the first request wait).
    client = openai.OpenAI(base_url=cluster.base_url,
                           api_key=cluster.spec.api_key or os.environ.get("CBSERVE_API_KEY") or "unused",
                           max_retries=3, timeout=120)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=16,
                                           temperature=0.0)
    print(f"[demo] completion ({completion.usage.completion_tokens} tokens): {completion.choices[0].text!r}",
          flush=True)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=16, temperature=0.0)
    print(f"[demo] chat ({chat.usage.completion_tokens} tokens): {chat.choices[0].message.content!r}", flush=True)


def _raise_interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    try:
        spec = spec_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # SIGTERM takes the Ctrl-C path: drain the router, then the pods. SIGINT is set too, because a
    # shell starts background jobs with SIGINT ignored, and Python then never raises KeyboardInterrupt.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    for name in ("httpx", "httpx2", "httpcore", "openai"):   # not one line per readiness probe
        logging.getLogger(name).setLevel(logging.WARNING)
    cluster = LocalCluster(spec, sink=stderr_sink, log_dir=args.log_dir, listener=take(spec.host, spec.port))
    control = None
    try:
        cluster.start()
        control = ControlServer(cluster, default_socket_path(cluster.router_port)).start()
        print(describe(cluster), flush=True)
        print(f"Change the pod counts with: cbserve scale --port {cluster.router_port} --decode N", flush=True)
        if args.demo:
            run_demo(cluster)
        while True:
            if args.exit_on_failure:
                cluster.check_alive("unexpectedly")
            else:
                cluster.supervise()
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("stopping: draining the router, then the pods (Ctrl-C again to kill)", file=sys.stderr, flush=True)
        try:
            killed = cluster.stop()
        except KeyboardInterrupt:
            return 130
        if killed:
            print(f"killed after the drain period: {', '.join(killed)}", file=sys.stderr)
        return 0
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        cluster.stop()
        return 1
    except Exception as e:  # the demo request failed: say why, stop everything
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        cluster.stop()
        return 1
    finally:
        if control is not None:
            control.close()
