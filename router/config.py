"""RouterConfig: every knob of the router in one frozen value, checked once at construction.

Field names follow the `cbserve router` flags (`--slo-ttft-ms` -> `slo_ttft_ms`), so a flag, a config
field and the metric or log line that talks about the same concept share one name.
"""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass, field

from pod.security import ClusterSecurity
from router.structured.flags import check_output_flags

POLICIES = ("goodput", "round_robin", "least_loaded")
ADMISSION_MODES = ("queue", "reject")
DISCOVERY_MODES = ("static", "file", "kubernetes")


def _check_address(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"pod address must be HOST:PORT, got {address!r}")


def read_api_key_file(path: str) -> str:
    """The key in `path`, surrounding whitespace dropped (`echo key > file` works); raises
    ValueError for an unreadable or empty file (never "no auth")."""
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"cannot read the API key file {path}: {exc.strerror}") from None
    if not key:
        raise ValueError(f"the API key file {path} is empty")
    return key


@dataclass(frozen=True)
class RouterConfig:
    """How the router finds pods, routes, admits and serves requests."""

    model: str = "tiny"                      # preset name or model directory (tokenizer + config.json)
    served_model_name: str | None = None     # the `model` clients send; default: `model`
    host: str = "127.0.0.1"
    port: int = 8000
    # A listening socket inherited as this file descriptor, served instead of binding host:port
    # (`cbserve up` binds first, so a client never sees "connection refused" while the router
    # process starts or restarts; systemd socket activation works the same way).
    listen_fd: int | None = None
    # Discovery: static addresses, a JSON file of them re-read when it changes (`pods_file`), or
    # Kubernetes EndpointSlices of the named Services.
    discovery: str = "static"
    pods_file: str | None = None
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    namespace: str = "default"
    prefill_service: str = "cbserve-prefill"
    decode_service: str = "cbserve-decode"
    colocated_service: str | None = None
    grpc_port_name: str = "grpc"
    # Routing and admission.
    policy: str = "goodput"
    slo_ttft_ms: float = 500.0
    slo_tpot_ms: float = 50.0
    admission: str = "queue"
    max_queue_seconds: float = 5.0
    max_queue_size: int = 1024
    # A request that finds no ready pod while discovery knows pods that are starting (or restarting,
    # or being replaced) waits this long for one, then gets 503 with Retry-After. 0: 503 at once.
    startup_wait_seconds: float = 60.0
    max_retries: int = 2                     # extra attempts on other pods, before the first token only
    kv_transport: str = ""                   # GenerateRequest.kv_transport: "" (grpc), "grpc" or "nccl"
    local_prefill_fallback: bool = True      # no prefill pod routable: decode pods prefill locally
    # Serving. The API key: `api_key`, else the file `api_key_file`, else the variable `api_key_env`.
    api_key_env: str | None = "CBSERVE_API_KEY"
    api_key: str | None = field(default=None, repr=False)
    api_key_file: str | None = None
    max_request_body_bytes: int = 16 << 20   # larger bodies get 413 before they are read
    enable_tokenizer_info_endpoint: bool = False   # GET /tokenizer_info (vLLM's; shows the chat template)
    max_model_len: int | None = None         # None: from the pods' Handshake / the model's config.json
    request_timeout_seconds: float = 600.0   # the deadline every RPC carries
    drain_seconds: float = 30.0
    # Load tracking and pod health.
    load_interval_seconds: float = 0.05      # WatchLoad interval; polling falls back to the same period
    probe_interval_seconds: float = 1.0      # how often a pod taken out is probed for re-admission
    # A decode pod whose Session says nothing (not even its once-a-second heartbeat) for this long
    # while it has requests is frozen: its requests fail over (router.pod_session).
    pod_inactivity_seconds: float = 10.0
    default_prefill_tokens_per_second: float = 20000.0   # until a pod reports its measured rate
    prefix_affinity_entries: int = 200_000   # block hashes remembered for prefix affinity
    # LoRA: requests may name an adapter the pods serve (`model`); runtime loading through
    # /v1/load_lora_adapter, fanned out to every pod (which must allow it too).
    enable_lora: bool = False
    allow_runtime_lora_updating: bool = False
    # Trust: the deployment secret every pod call carries, KV handles, TLS (pod/security.py).
    security: ClusterSecurity = ClusterSecurity()
    # Structured outputs, tool calls, reasoning (router/structured/, router/tools/, router/reasoning/).
    tool_call_parser: str | None = None      # hermes | llama3_json | mistral (vLLM's names)
    enable_auto_tool_choice: bool = False    # tool_choice "auto" (needs a parser), as vLLM
    reasoning_parser: str | None = None      # deepseek_r1 | qwen3
    exclude_tools_when_tool_choice_none: bool = False
    max_schema_bytes: int = 64 << 10         # one schema, regex, grammar or choice list
    max_schema_depth: int = 32
    max_tools: int = 128

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "colocated"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = tuple(a for a in value.split(",") if a)
            object.__setattr__(self, name, tuple(value))
            for address in getattr(self, name):
                _check_address(address)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {ADMISSION_MODES}, got {self.admission!r}")
        if self.kv_transport not in ("", "grpc", "nccl"):
            raise ValueError(f"kv_transport must be 'grpc' or 'nccl', got {self.kv_transport!r}")
        if self.discovery not in DISCOVERY_MODES:
            raise ValueError(f"discovery must be one of {DISCOVERY_MODES}, got {self.discovery!r}")
        if self.discovery == "file" and not self.pods_file:
            raise ValueError("--discovery file needs --pods-file PATH")
        if self.discovery == "static":
            if self.colocated and (self.prefill or self.decode):
                raise ValueError("use either --colocated or --prefill/--decode, not both")
            if bool(self.prefill) != bool(self.decode):
                raise ValueError("--prefill and --decode must both be given (or use --colocated)")
        for name in ("slo_ttft_ms", "slo_tpot_ms", "request_timeout_seconds", "load_interval_seconds",
                     "probe_interval_seconds", "default_prefill_tokens_per_second", "pod_inactivity_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.load_interval_seconds > 0.1:
            raise ValueError("load_interval_seconds must be <= 0.1 (routing needs fresh load)")
        for name in ("max_queue_seconds", "drain_seconds", "startup_wait_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_queue_size < 0 or self.max_retries < 0:
            raise ValueError("max_queue_size and max_retries must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.max_request_body_bytes < 1024:
            raise ValueError(f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}")
        if self.listen_fd is not None and self.listen_fd < 0:
            raise ValueError(f"listen_fd must be >= 0, got {self.listen_fd}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535 (0: any free port), got {self.port}")
        check_output_flags(self)

    @property
    def model_name(self) -> str:
        """The model id clients name in requests and `/v1/models` lists."""
        return self.served_model_name or self.model

    @property
    def disaggregated(self) -> bool:
        return not self.colocated and (self.discovery == "static" or self.colocated_service is None)

    def resolved_api_key(self) -> str | None:
        """The key every /v1 request must present, or None for no auth."""
        if self.api_key:
            return self.api_key
        if self.api_key_file:
            return read_api_key_file(self.api_key_file)
        if self.api_key_env:
            return os.environ.get(self.api_key_env) or None
        return None
