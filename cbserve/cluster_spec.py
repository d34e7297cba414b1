"""ClusterSpec: what `cbserve up` / `LocalCluster` starts, and the command line of every child.

The flags written here are the process contract (`cbserve prefill|decode|router`), so the local
cluster runs the same commands as the Helm chart's containers.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import DEFAULT_GPU_MEMORY_UTILIZATION

POLICIES = ("goodput", "round_robin", "least_loaded")
KV_TRANSPORTS = ("grpc", "nccl")


@dataclass(frozen=True)
class ClusterSpec:
    """One local cluster: either `num_prefill` + `num_decode` pods, or `num_colocated` engines."""

    model: str = "tiny"
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0           # > 0: aggregated baseline, no prefill/decode pods
    host: str = "127.0.0.1"          # the router's bind address (pods always bind loopback)
    port: int = 8000                 # the router's port; 0: any free port
    policy: str = "goodput"
    slo_ttft_ms: float = 500.0
    slo_tpot_ms: float = 50.0
    kv_transport: str = "grpc"
    # Engine flags passed to every pod (None: the pod's default).
    device: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    tensor_parallel_size: int = 1    # ranks per pod (on CUDA: consecutive GPUs from `device`)
    prefill_tensor_parallel_size: int | None = None   # prefill pods' ranks (None: tensor_parallel_size)
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    num_blocks: int | None = None
    # The device's share for all the pods on it (None: 0.9); each pod's flag gets an even part.
    gpu_memory_utilization: float | None = None
    prefix_caching: bool = True
    enforce_eager: bool = False
    speculative_config: str | None = None   # --speculative-config JSON, for decode and colocated pods
    threads_per_pod: int | None = None   # CBSERVE_NUM_THREADS / OMP_NUM_THREADS of each child
    startup_timeout: float = 300.0
    drain_seconds: float = 10.0
    # How long a request that finds no ready pod waits for one that is starting or restarting
    # (the router's `--startup-wait-seconds`), so a burst sent as the cluster starts is served.
    startup_wait_seconds: float = 60.0
    router_args: tuple[str, ...] = ()    # extra `cbserve router` flags, e.g. ("--admission", "reject")
    # The router's API key (None: the router reads CBSERVE_API_KEY, if set). Only the router gets
    # it, in its environment: never on a command line (`ps` shows those), never to a pod.
    api_key: str | None = field(default=None, repr=False)
    pod_args: tuple[str, ...] = ()       # extra flags for every pod

    def __post_init__(self) -> None:
        if self.num_colocated < 0 or self.num_prefill < 0 or self.num_decode < 0:
            raise ValueError("pod counts must be >= 0")
        if self.num_colocated:
            object.__setattr__(self, "num_prefill", 0)
            object.__setattr__(self, "num_decode", 0)
        elif self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("need at least 1 prefill and 1 decode pod (or --colocated K)")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not (self.slo_ttft_ms > 0 and self.slo_tpot_ms > 0):
            raise ValueError("SLOs must be > 0 ms")
        sizes = (self.tensor_parallel_size, self.prefill_tensor_parallel_size or 1)
        if min(sizes) < 1:
            raise ValueError(f"tensor parallel sizes must be >= 1, got {sizes}")
        if max(sizes) > 1 and self.kv_transport != "grpc":
            raise ValueError("tensor-parallel pods move KV over --kv-transport grpc only")
        for name in ("max_num_batched_tokens", "max_num_seqs", "num_blocks", "threads_per_pod"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.startup_timeout <= 0 or self.drain_seconds < 0 or self.startup_wait_seconds < 0:
            raise ValueError("startup_timeout must be > 0, drain_seconds and startup_wait_seconds >= 0")
        object.__setattr__(self, "router_args", tuple(self.router_args))
        object.__setattr__(self, "pod_args", tuple(self.pod_args))

    @property
    def colocated(self) -> bool:
        return self.num_colocated > 0

    def pod_roles(self) -> list[tuple[str, str]]:
        """(name, role) of every pod in start order."""
        if self.colocated:
            return [(f"colocated-{i}", "colocated") for i in range(self.num_colocated)]
        return ([(f"prefill-{i}", "prefill") for i in range(self.num_prefill)]
                + [(f"decode-{i}", "decode") for i in range(self.num_decode)])

    @property
    def shares_cuda_device(self) -> bool:
        """Several pods on one CUDA device: each must measure its memory alone, so they start in turn."""
        return len(self.pod_roles()) > 1 and is_cuda(self.device)

    def pod_gpu_memory_utilization(self) -> float | None:
        """Each pod's `--gpu-memory-utilization` (every pod runs on `device`); None off CUDA or when
        `num_blocks` fixes the cache size."""
        if self.num_blocks is not None:
            return None
        return gpu_memory_shares([self.device or "cpu"] * len(self.pod_roles()), self.gpu_memory_utilization)[0]

    def engine_flags(self) -> list[str]:
        flags: list[str] = []
        for flag, value in (("--device", self.device), ("--dtype", self.dtype),
                            ("--quantization", self.quantization), ("--kv-cache-dtype", self.kv_cache_dtype),
                            ("--max-num-batched-tokens", self.max_num_batched_tokens),
                            ("--max-num-seqs", self.max_num_seqs), ("--num-blocks", self.num_blocks),
                            ("--gpu-memory-utilization", self.pod_gpu_memory_utilization())):
            if value is not None:
                flags += [flag, str(value)]
        if not self.prefix_caching:
            flags.append("--no-prefix-caching")
        if self.enforce_eager:
            flags.append("--enforce-eager")
        return flags

    def pod_argv(self, name: str, role: str, port: int, metrics_port: int, kv_store_port: int) -> list[str]:
        """`cbserve prefill|decode ...` for one pod; a colocated engine is a decode pod with no prefill pod."""
        command = "prefill" if role == "prefill" else "decode"
        argv = [command, "--model", self.model, "--host", "127.0.0.1", "--port", str(port),
                "--metrics-port", str(metrics_port), "--kv-transport", self.kv_transport,
                "--kv-store-port", str(kv_store_port), "--drain-seconds", _number(self.drain_seconds),
                "--pod-id", name, *self.engine_flags()]
        tp = self.prefill_tensor_parallel_size or self.tensor_parallel_size if role == "prefill" \
            else self.tensor_parallel_size
        if tp > 1:
            argv += ["--tensor-parallel-size", str(tp)]
        if role == "colocated":
            argv.append("--colocated")
        speculates, kv_cache_groups = pod_kv_flags(role, bool(self.speculative_config))
        if speculates:
            argv += ["--speculative-config", self.speculative_config]
        if kv_cache_groups != "auto":
            argv += ["--kv-cache-groups", kv_cache_groups]
        return argv + list(self.pod_args)

    def router_argv(self, port: int, addresses: dict[str, list[str]], pods_file: str | None = None) -> list[str]:
        """`cbserve router ...`: the pods by address, or, with `pods_file`, the file listing them
        (`--discovery file`: the pod set may change while the router runs)."""
        argv = ["router", "--model", self.model, "--host", self.host, "--port", str(port),
                "--policy", self.policy, "--slo-ttft-ms", _number(self.slo_ttft_ms),
                "--slo-tpot-ms", _number(self.slo_tpot_ms), "--drain-seconds", _number(self.drain_seconds),
                "--startup-wait-seconds", _number(self.startup_wait_seconds), "--kv-transport", self.kv_transport]
        if pods_file is not None:
            argv += ["--discovery", "file", "--pods-file", pods_file]
        elif self.colocated:
            argv += ["--colocated", ",".join(addresses["colocated"])]
        else:
            argv += ["--prefill", ",".join(addresses["prefill"]), "--decode", ",".join(addresses["decode"])]
        return argv + list(self.router_args)


def pod_kv_flags(role: str, speculative: bool, kv_cache_groups: str = "auto") -> tuple[bool, str]:
    """(does the pod speculate, its `--kv-cache-groups`) in a cluster whose decode pods speculate
    (`speculative`) or not. Drafts are verified where decode steps run; a speculating decode pod
    keeps one KV group (its draft shares the target's tables), and both pods of a pull must run
    the same groups: so must its prefill pods (the chart does the same, helm/templates/_pool.tpl;
    the capacity planner's pods too, `cbserve.planner.sim_pod.PodKV`)."""
    if speculative and role == "prefill":
        return False, "single"
    return speculative, kv_cache_groups


def is_cuda(device: str | None) -> bool:
    return device is not None and (device == "cuda" or device.startswith("cuda:"))


def gpu_memory_shares(devices: Sequence[str], utilization: float | None) -> list[float | None]:
    """Each pod's `--gpu-memory-utilization`, given every pod's device: the device's share
    (`utilization`, None: 0.9) split evenly between the pods on it, rounded down to 1e-4 so the
    parts never add up to more. None for pods off CUDA (the flag is unused there).

    `cuda` and `cuda:0` are one device (a fresh process's current device is 0)."""
    total = DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else utilization
    keys = [_device_key(d) for d in devices]
    counts = Counter(keys)
    return [None if key is None else math.floor(total / counts[key] * 10_000 + 1e-9) / 10_000 for key in keys]


def _device_key(device: str) -> str | None:
    if not is_cuda(device):
        return None
    return "cuda:0" if device == "cuda" else device


def _number(value: float) -> str:
    """A number as a flag value: `30` rather than `30.0` for whole values."""
    return str(int(value)) if float(value).is_integer() else str(value)
