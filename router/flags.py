"""`cbserve router` flags -> RouterConfig. The CLI adds these to its subparser and calls `run`.

Flag names are the config field names with dashes (`--slo-ttft-ms` -> `slo_ttft_ms`).
"""

from __future__ import annotations

import argparse

from pod.security import add_security_flags, security_from_args
from router.config import ADMISSION_MODES, DISCOVERY_MODES, POLICIES, RouterConfig
from router.structured.flags import add_output_arguments, output_config_kwargs


def _addresses(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(",") if a.strip())


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    """Add every router flag to `p` (defaults come from RouterConfig)."""
    d = RouterConfig()
    p.add_argument("--model", default=d.model, help="preset (tiny, small) or model directory: tokenizer + config.json")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    p.add_argument("--host", default=d.host, help="bind address (default loopback; the chart passes 0.0.0.0)")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--listen-fd", type=int, default=None, metavar="FD",
                   help="serve on this inherited, already listening socket instead of binding --host/--port")
    p.add_argument("--prefill", type=_addresses, default=(), help="prefill pod addresses HOST:PORT,...")
    p.add_argument("--decode", type=_addresses, default=(), help="decode pod addresses HOST:PORT,...")
    p.add_argument("--colocated", type=_addresses, default=(), help="colocated pod addresses HOST:PORT,...")
    p.add_argument("--discovery", choices=DISCOVERY_MODES, default=d.discovery,
                   help="static: --prefill/--decode/--colocated; file: the JSON --pods-file, re-read when it "
                        "changes; kubernetes: the Services' EndpointSlices")
    p.add_argument("--pods-file", default=None, metavar="PATH",
                   help='with --discovery file: {"prefill": [HOST:PORT, ...], "decode": [...]} or {"colocated": [...]}')
    p.add_argument("--namespace", default=d.namespace)
    p.add_argument("--prefill-service", default=d.prefill_service)
    p.add_argument("--decode-service", default=d.decode_service)
    p.add_argument("--colocated-service", default=None, help="watch one Service of colocated pods instead")
    p.add_argument("--grpc-port-name", default=d.grpc_port_name)
    p.add_argument("--policy", choices=POLICIES, default=d.policy)
    p.add_argument("--slo-ttft-ms", type=float, default=d.slo_ttft_ms)
    p.add_argument("--slo-tpot-ms", type=float, default=d.slo_tpot_ms)
    p.add_argument("--admission", choices=ADMISSION_MODES, default=d.admission)
    p.add_argument("--max-queue-seconds", type=float, default=d.max_queue_seconds)
    p.add_argument("--max-queue-size", type=int, default=d.max_queue_size)
    p.add_argument("--startup-wait-seconds", type=float, default=d.startup_wait_seconds,
                   help="how long a request that finds no ready pod waits for one that is starting, restarting "
                        "or being replaced, before 503 with Retry-After (0: at once)")
    p.add_argument("--max-retries", type=int, default=d.max_retries)
    p.add_argument("--kv-transport", choices=["grpc", "nccl"], default=None,
                   help="KV transport decode pods use to pull from prefill pods (default: the pods' own)")
    p.add_argument("--no-local-prefill-fallback", action="store_true",
                   help="with no prefill pod routable, answer 503 instead of letting decode pods prefill locally")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="API key every /v1 request must present (visible in `ps`: for development; in "
                          "production use --api-key-file or the environment variable)")
    key.add_argument("--api-key-file", default=None, help="file holding the API key (e.g. a mounted Secret)")
    p.add_argument("--api-key-env", default=d.api_key_env,
                   help="environment variable holding the API key, read when neither flag above is given")
    p.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="larger request bodies get 413 before they are read")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the tokenizer's configuration and chat template, which "
                        "lm-evaluation-harness's remote tokenizer reads), as vLLM does; off by default")
    p.add_argument("--request-timeout-seconds", type=float, default=d.request_timeout_seconds)
    p.add_argument("--drain-seconds", type=float, default=d.drain_seconds)
    p.add_argument("--pod-inactivity-seconds", type=float, default=d.pod_inactivity_seconds,
                   help="a decode pod silent this long (no tokens, no heartbeat) while it has requests is "
                        "taken as frozen: its requests fail over")
    p.add_argument("--enable-lora", action="store_true",
                   help="accept requests whose `model` is a LoRA adapter the pods serve (listed in /v1/models)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, fanned out to every pod "
                        "(the pods need --allow-runtime-lora-updating and --lora-root too)")
    add_output_arguments(p, d)
    add_security_flags(p, pod=False)


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    """RouterConfig from parsed flags; raises ValueError with a readable message on a bad combination."""
    if args.discovery == "static" and not (args.prefill or args.decode or args.colocated):
        raise ValueError("give --prefill and --decode, or --colocated, or --discovery kubernetes")
    config = RouterConfig(
        model=args.model, served_model_name=args.served_model_name, host=args.host, port=args.port,
        listen_fd=args.listen_fd,
        discovery=args.discovery, pods_file=args.pods_file, prefill=args.prefill, decode=args.decode, colocated=args.colocated,
        namespace=args.namespace, prefill_service=args.prefill_service, decode_service=args.decode_service,
        colocated_service=args.colocated_service, grpc_port_name=args.grpc_port_name, policy=args.policy,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, admission=args.admission,
        max_queue_seconds=args.max_queue_seconds, max_queue_size=args.max_queue_size,
        startup_wait_seconds=args.startup_wait_seconds,
        max_retries=args.max_retries, kv_transport=args.kv_transport or "",
        local_prefill_fallback=not args.no_local_prefill_fallback, api_key_env=args.api_key_env or None,
        api_key=args.api_key or None, api_key_file=args.api_key_file,
        max_request_body_bytes=args.max_request_body_bytes,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        max_model_len=args.max_model_len, request_timeout_seconds=args.request_timeout_seconds,
        drain_seconds=args.drain_seconds, pod_inactivity_seconds=args.pod_inactivity_seconds,
        enable_lora=args.enable_lora or args.allow_runtime_lora_updating,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating, security=security_from_args(args),
        **output_config_kwargs(args))
    config.resolved_api_key()    # an unreadable or empty --api-key-file fails here, with its message
    return config
