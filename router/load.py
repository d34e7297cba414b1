"""Load tracking: what each pod last reported, plus what the router sent it since.

Each pod streams `LoadReport`s (`WatchLoad`, every `load_interval_seconds` <= 100 ms; `GetLoad`
polling at the same period if a pod lacks the stream). Between two reports the router counts what
it dispatched itself, so a burst arriving within one report interval does not all land on the pod
that looked idle. A pod is routable only while it is healthy (it answered its last probe and its
load stream is alive), its gRPC health is not NOT_SERVING (a stalled engine reports that:
`pod/stall.py`), it is not draining, and discovery lists it; one whose reports stopped for
`LOAD_SILENCE_SECONDS` gets requests only when no other pod of its role can take them. A pod that fails a call is taken out
at once (`mark_failed`) and re-admitted only after a probe succeeds `probe_interval_seconds` later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2

from wire import cbserve_pb2 as pb
from pod.security import ClusterSecurity
from router.discovery.base import PodEndpoint
from router.pod_client import PodClient
from router.predict import LatencyCalibration, RecentQuantile, StepTimeModel, tpot_calibration, ttft_calibration

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_SECONDS = 2.0
# A pod streams a report every `load_interval_seconds` (50 ms); one silent for this long (20
# reports) is likely frozen or cut off (keepalive ends its connection within ~8 s), so new requests
# go to another pod of its role meanwhile: a frozen pod's last report says it is idle, and it would
# draw every request until keepalive noticed. Only to another pod: one whose event loop was merely
# starved on a busy machine must not turn into a 503 when it is the only one, and with several
# starved, all of them still count.
LOAD_SILENCE_SECONDS = 1.0
# ... and while the others sent this many reports each: a router whose own event loop stalled for
# a second (a loaded machine) has read nobody's reports meanwhile, and must not take the first pod
# it hears from again as the only live one.
LOAD_SILENCE_REPORTS = 10


@dataclass(eq=False)   # identity: a pod is itself, whatever its load
class PodState:
    """The router's view of one pod. Mutated only on the event loop's thread."""

    endpoint: PodEndpoint
    client: PodClient
    report: pb.LoadReport | None = None
    report_time: float = 0.0                 # monotonic time the last report arrived
    report_seq: int = 0                      # `LoadTracker.num_reports` when it arrived
    model: pb.ModelInfo | None = None
    healthy: bool = False
    serving: bool = True                     # its gRPC health is not NOT_SERVING (engine stalled, drain)
    num_inflight: int = 0                    # requests the router sent and has not seen finish
    # Of those, a prefill pod's that it has answered: their decode goes on on another pod, so they
    # take no more of this pod's steps (its load), yet its channel stays open for them (an Abort of
    # a sequence cut short frees the KV it holds for the pull).
    num_answered: int = 0
    # (monotonic send time, prefill tokens, context tokens) of requests sent since the last report:
    # what it has to compute (the prompt less what its prefix cache probably holds), and what it
    # will hold.
    unreported: deque[tuple[float, int, int]] = field(default_factory=deque)
    step_model: StepTimeModel = field(default_factory=StepTimeModel)
    # Observed / predicted TPOT of requests this router ran here (decode and colocated pods).
    tpot_calibration: LatencyCalibration = field(default_factory=tpot_calibration)
    # Seconds from P's first token to this decode pod's first new one (the KV pull, its first step):
    # the median of recent ones (the tail is the calibration's).
    pd_gap: RecentQuantile = field(default_factory=lambda: RecentQuantile(quantile=0.5))
    # Observed / predicted TTFT (from routing to the first token) here (prefill and colocated pods).
    ttft_calibration: LatencyCalibration = field(default_factory=ttft_calibration)
    last_context_tokens: int = 0             # context tokens in the pod's latest reported step
    poll_load: bool = False                  # WatchLoad does not work on this pod: poll GetLoad
    admitted_before: bool = False            # it was routable once: a re-admission forgets its history
    # Monotonic seconds; the capacity planner passes its virtual clock (`cbserve.planner`).
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    @property
    def address(self) -> str:
        return self.endpoint.address

    @property
    def role(self) -> str:
        return self.endpoint.role

    @property
    def routable(self) -> bool:
        return self.healthy and self.serving and not (self.report is not None and self.report.draining)

    @property
    def silent(self) -> bool:
        """No load report for `LOAD_SILENCE_SECONDS`: routed to only when no other pod can be."""
        return self.clock() - self.report_time >= LOAD_SILENCE_SECONDS

    def apply_report(self, report: pb.LoadReport, now: float) -> None:
        # GetLoad (and the first message of WatchLoad) repeat the pod's recent samples; a sample seen
        # in the previous report is the same step, so only the others are new.
        previous = {(x.num_seqs, x.num_context_tokens, x.num_prefill_tokens, x.seconds)
                    for x in self.report.step_samples} if self.report is not None else set()
        self.report = report
        self.report_time = now
        # What the report now includes is no longer the router's to count.
        while self.unreported and self.unreported[0][0] <= now:
            self.unreported.popleft()
        for sample in report.step_samples:
            if (sample.num_seqs, sample.num_context_tokens, sample.num_prefill_tokens, sample.seconds) in previous:
                continue
            self.step_model.add(sample.num_seqs, sample.num_context_tokens, sample.num_prefill_tokens,
                                sample.seconds)
            self.last_context_tokens = sample.num_context_tokens

    def forget_history(self) -> None:
        """Back in routing after being out (restarted, thawed, reconnected): what was learnt about
        it describes another process, or one that was stalled; a 10 s step or a calibration fed by
        requests that hung there would keep it looking slow (and shed its load) long after."""
        self.step_model = StepTimeModel()
        self.tpot_calibration = tpot_calibration()
        self.pd_gap = RecentQuantile(quantile=0.5)
        self.ttft_calibration = ttft_calibration()
        self.unreported.clear()
        self.last_context_tokens = 0
        self.report = None

    def on_dispatch(self, num_prompt_tokens: int, num_prefill_tokens: int | None = None) -> None:
        """The router sent it a request of `num_prompt_tokens`, `num_prefill_tokens` of which it
        has to compute (default: all; a decode pod that pulls the KV: 0)."""
        self.num_inflight += 1
        prefill = num_prompt_tokens if num_prefill_tokens is None else num_prefill_tokens
        self.unreported.append((self.clock(), prefill, num_prompt_tokens))

    def on_answered(self) -> None:
        """A prefill pod answered a request it was sent: its part of the sequence is done."""
        self.num_answered += 1

    def on_finish(self, answered: bool = False) -> None:
        """A request it was sent is over (`answered`: `on_answered` counted it)."""
        self.num_inflight = max(0, self.num_inflight - 1)
        if answered:
            self.num_answered = max(0, self.num_answered - 1)

    # Load as routing sees it: the last report plus the router's own dispatches since.
    @property
    def queued_prefill_tokens(self) -> int:
        reported = self.report.prefill_queue_tokens if self.report else 0
        return reported + sum(tokens for _, tokens, _ in self.unreported)

    @property
    def num_requests(self) -> int:
        """Waiting + running at the pod, or the router's in-flight count if that is larger, less what
        a prefill pod has answered: a sequence decoding elsewhere is in none of its batches, and
        counted there it priced every queued prompt's steps at the whole cluster's batch (session
        16, `docs/benchmarks.md`: "The prefill pod's in-flight count")."""
        reported = (self.report.num_waiting + self.report.num_running) if self.report else 0
        return max(reported + len(self.unreported), self.num_inflight - self.num_answered)

    @property
    def context_tokens(self) -> int:
        return self.last_context_tokens + sum(tokens for _, _, tokens in self.unreported)

    @property
    def free_block_ratio(self) -> float:
        if self.report is None or self.report.num_total_blocks <= 0:
            return 1.0
        return self.report.num_free_blocks / self.report.num_total_blocks

    @property
    def max_num_batched_tokens(self) -> int:
        """The pod's token budget per step (0: not reported)."""
        return self.report.max_num_batched_tokens if self.report else 0

    @property
    def step_seconds_ewma(self) -> float:
        return self.report.step_seconds_ewma if self.report else 0.0


class LoadTracker:
    """Keeps one PodState per discovered endpoint, fed by its load stream and health probes."""

    def __init__(self, load_interval_seconds: float = 0.05, probe_interval_seconds: float = 1.0,
                 close_grace_seconds: float = 600.0, pod_inactivity_seconds: float = 10.0,
                 security: ClusterSecurity = ClusterSecurity()) -> None:
        self.security = security                         # how to reach pods: secret, TLS, KV handles
        self.load_interval_seconds = load_interval_seconds
        self.probe_interval_seconds = probe_interval_seconds
        self.close_grace_seconds = close_grace_seconds   # longest wait for a removed pod's calls
        self.pod_inactivity_seconds = pod_inactivity_seconds
        self.pods: dict[str, PodState] = {}
        self.num_reports = 0                             # load reports received, from every pod
        self._tasks: dict[str, asyncio.Task] = {}
        self._health_tasks: dict[str, asyncio.Task] = {}
        self._closing: dict[asyncio.Task, PodState] = {}   # removed pods, until their channel closed
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Called after every report and every change in which pods are routable."""
        self._listeners.append(listener)

    def _notify(self) -> None:
        for listener in self._listeners:
            listener()

    def routable(self, role: str) -> list[PodState]:
        """The pods of `role` that may get requests: routable ones, the silent ones only if no other."""
        pods = [p for p in self.pods.values() if p.role == role and p.routable]
        return [p for p in pods if not self.silent(p)] or pods

    def silent(self, pod: PodState) -> bool:
        """No report from `pod` for `LOAD_SILENCE_SECONDS` while the other pods sent
        `LOAD_SILENCE_REPORTS` each: likely frozen or cut off, not just a slow router loop."""
        others = sum(1 for p in self.pods.values() if p is not pod and p.healthy)
        return pod.silent and self.num_reports - pod.report_seq >= LOAD_SILENCE_REPORTS * max(1, others)

    def _apply(self, pod: PodState, report: pb.LoadReport) -> None:
        pod.apply_report(report, time.monotonic())
        self.num_reports += 1
        pod.report_seq = self.num_reports

    def set_endpoints(self, endpoints: frozenset[PodEndpoint]) -> None:
        """Discovery listener: start tracking new endpoints, drop vanished ones."""
        wanted = {e.address: e for e in endpoints}
        for address in list(self.pods):
            if address not in wanted or wanted[address].role != self.pods[address].role:
                self._remove(address)
        for address, endpoint in wanted.items():
            if address not in self.pods:
                pod = PodState(endpoint, PodClient(address, endpoint.role, self.pod_inactivity_seconds,
                                                   security=self.security))
                self.pods[address] = pod
                self._tasks[address] = asyncio.get_running_loop().create_task(self._track(pod, 0.0))
                self._health_tasks[address] = asyncio.get_running_loop().create_task(self._check_health(pod))
        self._notify()

    def _remove(self, address: str) -> None:
        """Stop routing to a vanished pod; its channel closes once the calls already on it end.

        A pod that Kubernetes marks not-ready is usually draining: its in-flight streams are meant
        to finish, so closing the channel at once would cut them off.
        """
        pod = self.pods.pop(address)
        self._tasks.pop(address).cancel()
        self._health_tasks.pop(address).cancel()
        task = asyncio.get_running_loop().create_task(self._close_when_idle(pod))
        self._closing[task] = pod
        task.add_done_callback(self._closing.pop)

    async def _close_when_idle(self, pod: PodState) -> None:
        deadline = time.monotonic() + self.close_grace_seconds
        while pod.num_inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)    # let best-effort Aborts sent as the last calls ended go out
        await pod.client.close()

    def mark_failed(self, pod: PodState, reason: str) -> None:
        """Take `pod` out of routing now; it comes back after a successful probe."""
        if self.pods.get(pod.address) is not pod or not pod.healthy:
            return
        log.warning("pod %s (%s) taken out of routing: %s", pod.address, pod.role, reason)
        pod.healthy = False
        self._tasks[pod.address].cancel()
        self._tasks[pod.address] = asyncio.get_running_loop().create_task(
            self._track(pod, self.probe_interval_seconds))
        self._notify()

    async def close(self) -> None:
        """Stop tracking and close every pod's channel, removed pods' included: a grpc.aio channel
        left open outlives its event loop and gets its next event (a GOAWAY) on a closed one."""
        closing = dict(self._closing)
        for task in closing:
            task.cancel()
        await asyncio.gather(*closing, return_exceptions=True)
        for pod in closing.values():    # a task cancelled before it ran did not close its channel
            await pod.client.close()
        for address in list(self.pods):
            pod = self.pods.pop(address)
            tasks = [self._tasks.pop(address), self._health_tasks.pop(address)]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await pod.client.close()

    async def _probe(self, pod: PodState) -> bool:
        """Handshake (model info) and one GetLoad; both must answer for the pod to be routable.
        A pod that was routable before starts its history afresh (`PodState.forget_history`)."""
        try:
            handshake = await pod.client.handshake(_PROBE_TIMEOUT_SECONDS)
            report = await pod.client.get_load(_PROBE_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as exc:
            log.debug("probe of %s failed: %s", pod.address, exc.code())
            return False
        except Exception:  # a malformed answer must not end tracking: the pod just stays out
            log.exception("probe of %s failed", pod.address)
            return False
        if pod.admitted_before:
            pod.forget_history()
        pod.model = handshake.model
        self._apply(pod, report)
        return True

    async def _track(self, pod: PodState, initial_delay: float) -> None:
        """Probe until healthy, then follow the load stream; on any failure, out and probe again."""
        await asyncio.sleep(initial_delay)
        while True:
            if not await self._probe(pod):
                await asyncio.sleep(self.probe_interval_seconds)
                continue
            pod.healthy = pod.admitted_before = True
            self._notify()
            try:
                await self._follow_load(pod)
            except grpc.aio.AioRpcError as exc:
                log.warning("load stream of %s ended: %s", pod.address, exc.code())
            except Exception:
                log.exception("load stream of %s failed", pod.address)
            pod.healthy = False
            self._notify()
            await asyncio.sleep(self.probe_interval_seconds)

    async def _check_health(self, pod: PodState) -> None:
        """Poll the pod's gRPC health as Kubernetes' readiness probe does (Check, every probe
        interval): NOT_SERVING (its engine stalled, or it drains) takes it out of routing until it
        says SERVING again. A pod without the health service is judged by its probes and load
        stream alone. (Check, not Watch: the pods' health servicer runs a Watch on a blocking
        thread that outlives the call and keeps the process from exiting.)"""
        while True:
            try:
                reply = await pod.client.health.Check(health_pb2.HealthCheckRequest(service=""),
                                                      timeout=_PROBE_TIMEOUT_SECONDS)
                serving = reply.status != health_pb2.HealthCheckResponse.NOT_SERVING
                if serving != pod.serving:
                    log.warning("pod %s (%s) health: %s", pod.address, pod.role,
                                health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                    pod.serving = serving
                    self._notify()
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    pod.serving = True
                    return
                log.debug("health check of %s failed: %s", pod.address, exc.code())
            except Exception:  # a malformed answer must not end the checks
                log.exception("health check of %s failed", pod.address)
            await asyncio.sleep(self.probe_interval_seconds)

    async def _follow_load(self, pod: PodState) -> None:
        if not pod.poll_load:
            call = pod.client.watch_load(self.load_interval_seconds)
            received = False
            try:
                async for report in call:
                    received = True
                    self._apply(pod, report)
                    self._notify()
                return
            except grpc.aio.AioRpcError as exc:
                # The pod just answered a probe, so a stream that fails before its first report
                # (UNIMPLEMENTED, or a broken handler: UNKNOWN) is the stream's fault, not the pod's.
                if received or exc.code() not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNKNOWN):
                    raise
                log.warning("pod %s has no working WatchLoad (%s); polling GetLoad", pod.address, exc.code())
                pod.poll_load = True
            finally:
                call.cancel()
        while True:
            await asyncio.sleep(self.load_interval_seconds)
            report = await pod.client.get_load(_PROBE_TIMEOUT_SECONDS)
            self._apply(pod, report)
            self._notify()
