"""What both pods share: the engine thread, the gRPC server, health, metrics, load, drain.

A pod is one `Engine` in its own thread (`engine.loop.EngineLoop`) behind a `grpc.aio` server, in
two processes: the engine-core process (`pod.core`) holds this runtime with its engine, and the
server process holds `pod.core_client.CoreRuntime`, this runtime without an engine, fed by the
core's messages.
Health follows the standard `grpc.health.v1` service: SERVING once the model is loaded and warm,
NOT_SERVING while the engine thread is stalled (`pod.stall`) and from the first SIGTERM on,
while in-flight streams and pending KV pulls finish; the process exits when they are done or the
drain window has passed. Load reports and metrics are
read from a snapshot the engine thread refreshes, never from live engine state: every
`REFRESH_SECONDS` while busy (not every step: `engine.stats()` walks the prefill queue), and at
once after the step that leaves the engine idle or changes the count of held KV, so a client whose
stream (or Prefill call) has ended reads a report that includes it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import signal
import socket
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from wire import cbserve_pb2
from engine.engine import Engine, EngineConfig, EngineRequestError
from engine.loop import EngineLoop
from engine.metrics import EngineMetrics
from engine.outputs import EngineStats
from engine.sampling.sampler import TokenLogprobs
from engine.sampling.params import SamplingParams, SamplingParamsError, from_proto
from engine.tp.shard import TensorParallelError
from kvtransfer.grpc_options import server_options
from kvtransfer.layout import KVLayout, check_compatible
from pod.draft_kv import advertise_draft_kv
from pod.load_report import REFRESH_SECONDS, build_load_report
from pod.lora_rpc import lora_rpc
from pod.security import ClusterSecurity, advertise_address
from pod.stall import DEFAULT_STALL_SECONDS, stall_threshold, watch_engine

log = logging.getLogger(__name__)
NUM_SNAPSHOT_SAMPLES = 64  # step samples kept for load reports (each report sends up to 32 new ones)


@dataclass(frozen=True)
class PodConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 0                 # 0 = no metrics server
    pod_id: str = ""
    drain_seconds: float = 30.0
    kv_transport: str = "grpc"            # what this pod offers/uses: "grpc" | "nccl"
    kv_store_port: int = 0
    kv_ttl_seconds: float = 30.0
    local_prefill_fallback: bool = True
    fallback_max_queue_tokens: int = 16384  # local prefill only while the queue is below this
    security: ClusterSecurity = ClusterSecurity()   # secret, TLS, KV handles (pod/security.py)
    advertise_address: str = ""           # HOST:PORT[,...] the router dials, besides $CBSERVE_POD_IP or host
    health_port: int = 0                  # > 0: grpc.health.v1 also on this plaintext port (probes under TLS)
    stall_seconds: float = DEFAULT_STALL_SECONDS  # engine loop silent this long: not ready (pod/stall.py)

    def __post_init__(self) -> None:
        if self.kv_transport not in ("grpc", "nccl"):
            raise ValueError(f"kv_transport must be 'grpc' or 'nccl', got {self.kv_transport!r}")
        if self.drain_seconds < 0 or self.kv_ttl_seconds <= 0:
            raise ValueError("drain_seconds must be >= 0 and kv_ttl_seconds > 0")
        if not self.stall_seconds > 0:
            raise ValueError(f"stall_seconds must be > 0, got {self.stall_seconds}")


def bind_error(host: str, port: int) -> str:
    """Why `host:port` cannot be listened on, as the OS says it (e.g. "Address already in use")."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return "the gRPC server refused the address"


class RequestFailed(Exception):
    """Ends one request's RPC with a gRPC status (delivered through its output queue)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def refused(error: BaseException) -> RequestFailed:
    """The failure for a request the engine would not queue (its `add_request` raised)."""
    if isinstance(error, RequestFailed):
        return error
    code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(error, ValueError) else grpc.StatusCode.INTERNAL
    return RequestFailed(code, f"the engine refused the request: {error}")


def logprobs_to_pb(lp: TokenLogprobs | None) -> cbserve_pb2.TokenLogprobs | None:
    if lp is None:
        return None
    return cbserve_pb2.TokenLogprobs(logprob=lp.logprob, top=[
        cbserve_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def prompt_logprobs_to_pb(values) -> cbserve_pb2.PromptLogprobs | None:
    """`engine.prompt_logprobs.PromptLogprobs` (or None) as its wire message."""
    if values is None:
        return None
    msg = cbserve_pb2.PromptLogprobs()
    values.to_proto(msg)
    return msg


def logprobs_from_pb(msg: cbserve_pb2.TokenLogprobs | None) -> TokenLogprobs | None:
    if msg is None:
        return None
    return TokenLogprobs(msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))


class PodRuntime:
    """Owns the engine, its thread and the pod-wide plumbing; servicers hold one."""

    def __init__(self, engine_config: EngineConfig, pod: PodConfig, role_label: str) -> None:
        self.pod = pod
        self.role_label = role_label
        if engine_config.tensor_parallel_size > 1 and pod.kv_transport != "grpc":
            # KV of a tensor-parallel pod is gathered to / scattered from rank 0 (engine/tp/kv.py),
            # which the gRPC transport does; the pair process group would bypass it.
            raise TensorParallelError(
                f"--tensor-parallel-size {engine_config.tensor_parallel_size} needs --kv-transport grpc "
                f"(got {pod.kv_transport})")
        self.metrics = EngineMetrics(role_label)
        self.engine_config = engine_config
        self.engine: Engine | None = None
        self.model_info: cbserve_pb2.ModelInfo | None = None
        self.draft_kv = None             # engine core: the draft model's cache whose KV travels (pod.draft_kv)
        self.block_size = self.max_num_seqs = self.max_num_batched_tokens = 0
        self.snapshot: EngineStats | None = None
        if self.owns_engine:
            self._load_engine(engine_config)
        self.pod_id = pod.pod_id or f"{role_label}-{pod.host}:{pod.port}"
        # Every address the router may dial this pod at (KV handles name one): the derived one and
        # any given with --advertise-address (comma-separated: a pod behind a proxy has two).
        derived = advertise_address(pod.host, pod.port)
        given = [a.strip() for a in pod.advertise_address.split(",") if a.strip()]
        self.addresses = tuple(dict.fromkeys(given + ([derived] if derived else [])))
        self.address = self.addresses[0] if self.addresses else ""
        self.kv_handles = pod.security.handles
        self.loop: EngineLoop | None = None
        self.health = health.HealthServicer()
        self.draining = False
        self.stalled = False             # the engine thread is stuck (pod/stall.py): not ready
        self.num_inflight = 0            # open RPC streams that must finish before exit
        self.num_held = 0
        self._samples: list[tuple[int, object]] = []
        self._refreshed_at = 0.0
        self._steps_timed = 0
        self._idle = asyncio.Event()

    owns_engine = True   # False: the engine runs in another process (pod.core_client)

    def _load_engine(self, engine_config: EngineConfig) -> None:
        # The router turns ids into text; the engine detokenizes only requests with stop strings.
        self.engine = Engine(dataclasses.replace(engine_config, detokenize=False))
        self.layout = KVLayout.from_tensor(self.engine.kv_cache)
        if self.engine.tp_kv is not None:   # on the wire a block has every KV head, whatever the TP degree
            self.layout = dataclasses.replace(self.layout, num_kv_heads=self.engine.model_config.num_kv_heads)
        # KV groups (a mixed local/global model): the layout is a page's; pods compare the groups.
        self.model_info = self.layout.to_model_info(
            engine_config.model, self.engine.fingerprint, max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.model_config.vocab_size, layer_windows=self.engine.model_config.layer_windows,
            kv_transfer_window=self.engine.cache_config.sliding_window or 0,
            kv_group_windows=tuple(self.engine.config.cache.kv_group_windows),
            num_model_layers=self.engine.model_config.num_layers)
        self.draft_kv = advertise_draft_kv(self.engine, self.model_info)   # a draft model's cache (pod.draft_kv)
        self.block_size = self.engine.cache_config.block_size
        self.max_num_seqs = self.engine.scheduler_config.max_num_seqs
        self.max_num_batched_tokens = self.engine.scheduler_config.max_num_batched_tokens
        self.snapshot = self.engine.stats()

    # ------------------------------------------------------------------ engine thread hooks
    def after_step(self, engine: Engine, num_held: int = 0) -> None:
        """Engine thread, after every step: time it; refresh the snapshot if it is due, the held
        count changed, or the engine has nothing left to do."""
        if engine.num_steps != self._steps_timed and engine.step_samples:
            self._steps_timed = engine.num_steps
            self.metrics.step.observe(engine.step_samples[-1].seconds)
        if num_held != self.num_held or time.monotonic() - self._refreshed_at >= REFRESH_SECONDS \
                or not engine.has_unfinished_requests():
            self.refresh(engine, num_held)

    def refresh(self, engine: Engine, num_held: int = 0) -> None:
        """Engine thread: snapshot statistics for load reports and metrics."""
        self._refreshed_at = time.monotonic()
        self.snapshot = engine.stats()
        self.num_held = num_held
        self.metrics.update(self.snapshot, num_held)
        recent = list(engine.step_samples)[-NUM_SNAPSHOT_SAMPLES:]
        base = engine.num_steps - len(recent)
        self._samples = [(base + i, s) for i, s in enumerate(recent)]

    def warm_up(self) -> None:
        """One real request through the engine before SERVING (kernels compile on first use)."""
        engine = self.engine
        engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0.0), request_id="__warmup__")
        while engine.has_unfinished_requests():
            engine.step()
        engine.scheduler.release_request("__warmup__")
        engine.abort("__warmup__")
        engine.reset_step_stats()

    # ------------------------------------------------------------------ request intake
    def parse(self, prompt_token_ids, sampling: cbserve_pb2.SamplingParams, request_id: str):
        """Validate a request at the boundary; raises ValueError with a message for the client."""
        if not request_id:
            raise ValueError("request_id is required")
        try:
            params = from_proto(sampling)
        except SamplingParamsError as e:
            raise ValueError(f"invalid sampling parameter {e.param}: {e}") from None
        try:
            self.engine.make_request(list(prompt_token_ids), params, request_id="__validate__")
        except EngineRequestError as e:
            raise ValueError(str(e)) from None
        return list(prompt_token_ids), params

    def validate(self, request, check=None):
        """The boundary of a Prefill/Generate request: refuse while draining, validate it (plus
        `check(request)`, which raises ValueError); returns (prompt, params) or raises RequestFailed."""
        if self.draining:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"{self.role_label} pod is draining")
        try:
            parsed = self.parse(request.prompt_token_ids, request.sampling, request.request_id)
            if check is not None:
                check(request)
            return parsed
        except ValueError as e:
            self.metrics.rejected("invalid")
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    async def intake(self, request, context, check=None):
        """`validate` for a call of its own: a refusal ends the call with its status."""
        try:
            return self.validate(request, check)
        except RequestFailed as e:
            await context.abort(e.code, str(e))

    def kv_source_args(self) -> dict:
        """Extra `KVSource` arguments: a tensor-parallel pod sends whole blocks gathered from its ranks."""
        tp_kv = self.engine.tp_kv
        return {} if tp_kv is None else {"layout": self.layout, "read_blocks": tp_kv.read}

    def kv_sink_args(self) -> dict:
        """Extra `KVSink` arguments: a tensor-parallel pod scatters whole blocks to its ranks."""
        tp_kv = self.engine.tp_kv
        return {} if tp_kv is None else {"layout": self.layout, "write_blocks": tp_kv.write}

    def require_kv_handle(self, request, prefill_address: str | tuple[str, ...], hint: str = "") -> None:
        """Raise RequestFailed(PERMISSION_DENIED) unless `request.kv_handle` is the router's voucher
        for (request id, `prefill_address` or one of them) and unexpired (`kvtransfer.handles`);
        no-op when insecure."""
        if self.kv_handles is None:
            return
        handle = request.kv_handle if request.HasField("kv_handle") else None
        addresses = (prefill_address,) if isinstance(prefill_address, str) else prefill_address
        problems = [self.kv_handles.problem(handle, request.request_id, a) for a in addresses or ("",)]
        problem = None if None in problems else problems[0]
        if problem is not None:
            self.metrics.rejected("kv_handle")
            raise RequestFailed(grpc.StatusCode.PERMISSION_DENIED, problem + hint)

    async def check_kv_handle(self, request, prefill_address: str | tuple[str, ...], context,
                              hint: str = "") -> None:
        """`require_kv_handle` for a call of its own: a refusal ends the call with its status."""
        try:
            self.require_kv_handle(request, prefill_address, hint)
        except RequestFailed as e:
            await context.abort(e.code, str(e))

    def track(self) -> "_Inflight":
        return _Inflight(self)

    # ------------------------------------------------------------------ common RPCs
    async def handshake(self, request: cbserve_pb2.HandshakeRequest, context) -> cbserve_pb2.HandshakeResponse:
        if request.HasField("model"):
            problem = check_compatible(self.model_info, request.model)
            if problem:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"incompatible peer: {problem}")
        transports = ["grpc", "nccl"] if self.pod.kv_transport == "nccl" else ["grpc"]
        return cbserve_pb2.HandshakeResponse(model=self.model_info, pod_id=self.pod_id, kv_transports=transports)

    async def abort(self, request: cbserve_pb2.AbortRequest, context) -> cbserve_pb2.AbortResponse:
        found = await self.abort_request(request.request_id, "aborted by the client")
        return cbserve_pb2.AbortResponse(found=found)

    async def abort_request(self, request_id: str, reason: str) -> bool:
        """Abort in the engine (idempotent, frees blocks) and end the request's open RPC."""
        return await asyncio.wrap_future(self.abort_request_nowait(request_id, reason))

    def abort_request_nowait(self, request_id: str, reason: str):
        """As `abort_request`, without waiting (safe in `finally` of a cancelled handler)."""
        future = self.loop.abort(request_id)
        self.loop.fail(request_id, RequestFailed(grpc.StatusCode.ABORTED, reason))
        return future

    def load_report(self, since_step: int = -1) -> tuple[cbserve_pb2.LoadReport, int]:
        samples = [x for n, x in self._samples if n > since_step]
        last = self._samples[-1][0] if self._samples else since_step
        report = build_load_report(self.pod_id, self.role_label, self.snapshot, samples, draining=self.draining,
                                   block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens, num_held_kv=self.num_held)
        return report, last

    async def get_load(self, request, context) -> cbserve_pb2.LoadReport:
        return self.load_report()[0]

    async def watch_load(self, request: cbserve_pb2.WatchLoadRequest, context):
        interval = request.interval_seconds if request.interval_seconds > 0 else 0.05
        last = -1
        while True:
            report, last = self.load_report(last)
            yield report
            await asyncio.sleep(max(0.01, interval))

    # ------------------------------------------------------------------ serving
    def set_serving(self, serving: bool, service_name: str) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", service_name):
            self.health.set(name, status)

    def stall_threshold(self) -> float:
        return stall_threshold(self.pod.stall_seconds, (s.seconds for _, s in self._samples))

    def _on_stall_change(self, stalled: bool, service_name: str) -> None:
        """Not ready while stalled; the requests it holds fail with UNAVAILABLE, so the router
        retries them elsewhere (a prefill pod's pulls end too: decode pods prefill locally)."""
        self.stalled = stalled
        if not self.draining:
            self.set_serving(not stalled, service_name)
        if stalled:
            failed = self.loop.fail_all(lambda: RequestFailed(
                grpc.StatusCode.UNAVAILABLE, f"{self.role_label} pod {self.pod_id}: engine stalled"))
            if failed:
                log.warning("engine stalled: failed %d requests so that they run elsewhere", len(failed))

    async def serve(self, add_servicer, service_name: str, post_step=None, on_idle=None,
                    pending_work=lambda: 0) -> None:
        """Run until SIGTERM/SIGINT (or `stop`), then drain: unready at once, finish streams and
        pulls, exit. Returns the process's exit code."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        await self.start_engine(service_name, post_step, on_idle)
        security = self.pod.security
        server = grpc.aio.server(options=server_options(), interceptors=security.server_interceptors())
        add_servicer(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:   # the port is exclusive (server_options): a taken port fails here, loudly
            bound = security.add_port(server, f"{self.pod.host}:{self.pod.port}")
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise RuntimeError(f"cannot listen on {self.pod.host}:{self.pod.port}: "
                               f"{bind_error(self.pod.host, self.pod.port)}")
        servers = [server]
        if self.pod.health_port:   # the kubelet's gRPC probes speak plaintext only
            servers.append(grpc.aio.server(options=server_options()))
            health_pb2_grpc.add_HealthServicer_to_server(self.health, servers[-1])
            try:
                bound_health = servers[-1].add_insecure_port(f"{self.pod.host}:{self.pod.health_port}")
            except RuntimeError:
                bound_health = 0
            if bound_health == 0:
                raise RuntimeError(f"cannot listen on {self.pod.host}:{self.pod.health_port}: "
                                   f"{bind_error(self.pod.host, self.pod.health_port)}")
        if self.pod.metrics_port:
            start_http_server(self.pod.metrics_port, addr=self.pod.host, registry=self.metrics.registry)
        for s in servers:
            await s.start()
        self.set_serving(True, service_name)
        watchdog = asyncio.create_task(watch_engine(
            lambda: self.loop.last_iteration_at, self.stall_threshold,
            lambda stalled: self._on_stall_change(stalled, service_name)))
        log.info("%s pod %s serving on %s:%d (metrics :%s, %s, %s)", self.role_label, self.pod_id, self.pod.host,
                 bound, self.pod.metrics_port or "-", "TLS" if security.tls_cert else "plaintext",
                 "cluster secret required" if security.secret else "NO cluster secret: open to anyone")
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        await self._stop.wait()
        watchdog.cancel()
        self.draining = True
        self.set_serving(False, service_name)
        deadline = time.monotonic() + self.pod.drain_seconds
        log.info("draining: %d streams in flight, %d pending", self.num_inflight, pending_work())
        while time.monotonic() < deadline and (self.num_inflight or pending_work()):
            await asyncio.sleep(0.05)
        for s in servers:
            await s.stop(grace=max(0.0, min(1.0, deadline - time.monotonic())))
        self.loop.stop()
        log.info("drained; exiting")
        return self.exit_code

    exit_code = 0

    def stop(self, exit_code: int = 0) -> None:
        """Event loop: drain and exit as on SIGTERM, with `exit_code`."""
        self.exit_code = self.exit_code or exit_code
        self._stop.set()

    async def start_engine(self, service_name: str, post_step, on_idle) -> None:
        """Warm the engine up and start its thread (`self.loop`) before the server listens."""
        if self.engine.tp is not None:   # a lost rank: unready at once, then the process exits
            self.engine.tp.on_lost.append(lambda message: self.set_serving(False, service_name))
        self.warm_up()
        # Everything alive now (model, tokenizer, config) lives as long as the process: keep it out
        # of the collector's generations so GC pauses stay short in the step loop.
        gc.collect()
        gc.freeze()
        self.loop = EngineLoop(self.engine, asyncio.get_running_loop(), post_step=post_step, on_idle=on_idle)
        self.loop.start()


class CommonRPCs:
    """The RPCs both pod services have, answered by the pod's runtime (`self.rt`)."""

    rt: PodRuntime

    async def Handshake(self, request, context):
        return await self.rt.handshake(request, context)

    async def GetLoad(self, request, context):
        return await self.rt.get_load(request, context)

    async def WatchLoad(self, request, context):
        async for report in self.rt.watch_load(request, context):
            yield report

    async def Abort(self, request, context):
        return await self.rt.abort(request, context)

    async def LoadLoRAAdapter(self, request, context):
        return await lora_rpc(self.rt, "load_lora_adapter", request, context)

    async def UnloadLoRAAdapter(self, request, context):
        return await lora_rpc(self.rt, "unload_lora_adapter", request, context)


class _Inflight:
    """Counts an RPC as in flight for the drain (`async with runtime.track():`)."""

    def __init__(self, runtime: PodRuntime) -> None:
        self.runtime = runtime

    async def __aenter__(self):
        self.runtime.num_inflight += 1

    async def __aexit__(self, *exc):
        self.runtime.num_inflight -= 1
