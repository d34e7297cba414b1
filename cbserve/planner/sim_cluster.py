"""One simulated cluster: pods, KV pulls, the router's real routing core and the client, on virtual time.

What runs is production code: every pod's `Scheduler` and `KVCacheManager` (`sim_pod.SimPod`), and
the router's `Dispatcher` built by `router.dispatch.build_dispatcher` (load tracker, `PodState`s
fed the pods' `LoadReport`s every `load_interval_seconds`, the policy with its step-time model and
latency calibrations, prefix index, admission with its deadline-ordered queue). What is modelled:
step durations (`PodCosts`, times the cores' share `CpuShare` where pods share a machine, times one
machine-wide `Jitter`), the serving path's latencies
(`ServingCosts`), and KV transfer time (a message latency plus bytes / bandwidth, per message). A request's life, as the router runs it:

1. the client sends it at its arrival instant; the router has it `http_in_s` later and admits it
   (`Dispatcher.admit`: route now, wait in the queue on the TTFT budget left, or 429/503);
2. `rpc_s` later the pods have it: P `add_request`, D `add_remote_request` (disaggregated), or the
   colocated pod `add_request`;
3. P's steps publish KV progress (full blocks) and, at the step that samples it, the first token,
   which reaches the client `token_out_s` later; D reserves the prompt's blocks in a step
   (`reserved_request_ids`), opens a pull (`rpc_s`) that sends what P has computed, message by
   message, and the rest once P is done; when it has landed, D's next command pass runs
   `remote_kv_landed` and P releases its blocks;
4. every later D step gives a token, at the client `token_out_s` later; the router observes TTFT
   and TPOT (`Dispatcher.observe_ttft/observe_tpot`, feeding the calibrations), frees P's part
   when P's answer reaches it (`Dispatcher.prefill_answered`) and releases the pods
   (`Dispatcher.release`) at the end. A client cancellation (after `cancel_after_tokens`
   chunks) or timeout aborts the request on both pods.
The client's view is a `cbserve.goodput.stats.RequestResult`, the same record `loadgen` keeps for a
real run, so the benchmark's `summarize` turns both into the same row.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cbserve.cluster_spec import ClusterSpec
from cbserve.goodput.stats import RequestResult
from cbserve.goodput.workloads import RequestSpec
from cbserve.planner.cpu_share import CpuShare, CpuShareCosts
from cbserve.planner.sim_pod import SAMPLED_TOKEN_ID, Jitter, PodCosts, PodKV, SimPod
from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request
from engine.sampling.params import SamplingParams
from engine.scheduling.output import SchedulerOutput
from router.config import RouterConfig
from router.discovery.base import PodEndpoint
from router.dispatch import SequenceSpec, SequenceTrace, build_dispatcher
from router.errors import APIError
from router.load import PodState
from router.metrics import RouterMetrics
from router.policy import RoutingDecision, RoutingRequest, block_hashes


@dataclass(frozen=True)
class ServingCosts:
    """The serving path around the engine steps (measured in situ by `cbserve profile`)."""

    http_in_s: float = 0.0          # client send -> the router has the request (HTTP, tokenization)
    rpc_s: float = 0.0              # router -> pod call; a decode pod opening a KV pull
    token_out_s: float = 0.0        # a token sampled on a pod -> the client (and the router) has it
    kv_message_s: float = 0.0       # per KV message between pods
    kv_bytes_per_s: float = float("inf")
    cpu: CpuShareCosts = CpuShareCosts()    # the cores pods, router and client share (none: 0 cores)


@dataclass(frozen=True)
class PodShape:
    """Each pod's engine: scheduler knobs and KV cache (the flags the pods run with). `num_blocks`
    is the profiled engine's KV pages, `kv_bytes_per_token` every layer's K and V of a token; `kv`
    what the pods' KV groups follow (`sim_pod.PodKV`; default: one group)."""

    scheduler: SchedulerConfig
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    kv: PodKV = PodKV()

    def cache(self, prefix_caching: bool, role: str = "colocated") -> CacheConfig:
        return self.kv.cache(role, self.block_size, self.num_blocks, prefix_caching)

    def page_bytes(self, cache: CacheConfig) -> int:
        """Bytes of one page (block) of `cache`, as a pull sends it."""
        return self.kv_bytes_per_token // self.kv.num_layers * self.kv.page_layers(cache) * self.block_size


class _Flow:
    """One request in flight: where it runs, what the client has seen, the state of its KV pull."""

    __slots__ = ("request_id", "spec", "prompt", "result", "decision", "prefill", "decode", "start",
                 "routed_at", "first_at", "closed", "done", "prefill_ready", "prefill_done", "pull_wake",
                 "pull", "cancelled", "refused", "answered")

    def __init__(self, request_id: str, spec: RequestSpec, prompt: list[int], result: RequestResult,
                 decision: RoutingDecision, prefill: SimPod | None, decode: SimPod, start: float, now: float) -> None:
        self.request_id, self.spec, self.prompt, self.result = request_id, spec, prompt, result
        self.decision, self.prefill, self.decode = decision, prefill, decode
        self.start, self.routed_at = start, now
        self.first_at: float | None = None          # router time of the first token
        self.closed = False
        self.cancelled = False
        self.refused: str | None = None             # why a pod refused it
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.prefill_ready = 0                      # prompt tokens whose KV P has in full blocks
        self.prefill_done = False                   # P sampled the first token: all KV is there
        self.pull_wake = asyncio.Event()
        self.pull: asyncio.Task | None = None
        self.answered = False                       # the router has P's answer (`Dispatcher.prefill_answered`)


class SimCluster:
    """Pods and router of one configuration; `run(requests)` plays one open-loop run through them.
    `pod_costs` is one for every pod or one per role (prefill, decode, colocated; `alone` for the
    pod of a one-pod cluster).

    Create and use it inside a running (virtual-time) event loop; state carries over from one run to
    the next (prefix caches, the router's models and calibrations), as one cluster serves a
    benchmark's successive rates."""

    def __init__(self, fields: dict, shape: PodShape, pod_costs: PodCosts | dict[str, PodCosts], serving: ServingCosts,
                 slo_ttft_s: float, slo_tpot_s: float, prefix_caching: bool,
                 request_timeout_s: float = 60.0, router: RouterConfig | None = None,
                 jitter: Jitter | None = None, seed: int = 0) -> None:
        loop = asyncio.get_running_loop()
        self.clock = loop.time
        self.serving = serving
        self.shape = shape
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.request_timeout_s = request_timeout_s
        self.router_config = replace(router or RouterConfig(), policy=fields["policy"],
                                     slo_ttft_ms=slo_ttft_s * 1000, slo_tpot_ms=slo_tpot_s * 1000)
        self.metrics = RouterMetrics()
        self.dispatcher = build_dispatcher(self.router_config, self.metrics, clock=self.clock)
        # The policy breaks ties between equal pods at random (`MaxScorePicker`): seeded here, so a
        # prediction repeats exactly.
        for n, profile in enumerate(self.dispatcher.policy.profiles.values()):
            if isinstance(getattr(profile.picker, "rng", None), random.Random):
                profile.picker.rng = random.Random(f"picker:{seed}:{n}")
        spec = ClusterSpec(model="sim", port=0, **fields)
        self.cpu_share = CpuShare(serving.cpu.of(colocated=bool(fields.get("num_colocated"))), self.clock) \
            if serving.cpu.cores > 0 else None
        self.pods: dict[str, SimPod] = {}
        self._tasks: list[asyncio.Task] = []
        for name, role in spec.pod_roles():
            costs = pod_costs[role] if isinstance(pod_costs, dict) else pod_costs
            if isinstance(pod_costs, dict) and len(spec.pod_roles()) == 1 and "alone" in pod_costs:
                costs = pod_costs["alone"]      # no other engine steps beside it (`ServingProfile.alone_contention`)
            cache = shape.cache(prefix_caching, role)
            pod = SimPod(name, role, shape.scheduler, cache, costs, self._on_step, self.clock, jitter, self.cpu_share,
                         shape.page_bytes(cache))
            state = PodState(PodEndpoint(name, role, name), client=None, healthy=True, clock=self.clock)
            self.pods[name] = pod
            self.dispatcher.tracker.pods[name] = state
            self._tasks.append(loop.create_task(pod.run()))
            self._tasks.append(loop.create_task(self._report(pod, state)))
        self.flows: dict[str, _Flow] = {}
        self._ids = itertools.count()
        # Per pod, summed over load reports: [reports, running, prefill queue tokens, KV usage],
        # what the HPA's pod metrics average (`mean_load`).
        self._load: dict[str, list[float]] = {name: [0.0] * 4 for name in self.pods}

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()

    def reset_load(self) -> None:
        for sums in self._load.values():
            sums[:] = [0.0] * 4

    def mean_load(self, role: str) -> dict[str, float]:
        """The pods of `role`, averaged over the load reports since `reset_load`: running requests,
        prefill queue tokens and KV-cache usage per pod (the HPA's Pods metrics)."""
        sums = [self._load[n] for n, p in self.pods.items() if p.role == role]
        reports = sum(s[0] for s in sums)
        if not reports:
            return {}
        return {"running_requests": sum(s[1] for s in sums) / reports,
                "prefill_queue_tokens": sum(s[2] for s in sums) / reports,
                "kv_cache_usage": sum(s[3] for s in sums) / reports}

    @property
    def num_preemptions(self) -> int:
        return sum(p.scheduler.num_preemptions for p in self.pods.values())

    async def _report(self, pod: SimPod, state: PodState) -> None:
        """The pod's `WatchLoad` stream, as the router's load tracker applies it."""
        interval = self.router_config.load_interval_seconds
        sums = self._load[pod.name]
        while True:
            report = pod.load_report()
            sums[0] += 1
            sums[1] += report.num_running
            sums[2] += report.prefill_queue_tokens
            sums[3] += 1.0 - report.num_free_blocks / report.num_total_blocks if report.num_total_blocks else 0.0
            state.apply_report(report, self.clock())
            self.dispatcher.admission.wake()     # the tracker's listener: a report re-runs the queue
            await asyncio.sleep(interval)

    # ------------------------------------------------------------------ a run
    async def run(self, requests: Sequence[RequestSpec], prompts: Sequence[list[int]]) -> tuple[list[RequestResult], float]:
        """Play `requests` (arrival offsets from now) with their token ids; returns the client's
        results in request order and the seconds until the last one ended (loadgen's elapsed)."""
        start = self.clock()
        results = await asyncio.gather(*(self._client(r, p, start) for r, p in zip(requests, prompts)))
        return list(results), self.clock() - start

    async def _client(self, spec: RequestSpec, prompt: list[int], start: float) -> RequestResult:
        result = RequestResult(spec.index, spec.arrival_s)
        await asyncio.sleep(max(0.0, start + spec.arrival_s - self.clock()))
        result.sent_s = self.clock() - start
        try:
            await asyncio.wait_for(self._serve(spec, prompt, result, start), self.request_timeout_s)
        except asyncio.TimeoutError:
            result.outcome, result.error = "timeout", f"no answer within {self.request_timeout_s:.0f}s"
        result.done_s = self.clock() - start
        return result

    async def _serve(self, spec: RequestSpec, prompt: list[int], result: RequestResult, start: float) -> None:
        await asyncio.sleep(self.serving.http_in_s)
        request_id = f"sim-{next(self._ids)}"
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
        bs = self.shape.block_size
        routing = RoutingRequest(request_id, len(prompt), spec.max_tokens, self.slo_ttft_s, self.slo_tpot_s,
                                 block_hashes(prompt, bs), bs)
        now = self.clock()
        sequence = SequenceSpec(request_id, prompt, params, routing, now, now + self.router_config.request_timeout_seconds)
        try:
            decision = await self.dispatcher.admit(sequence, SequenceTrace())
        except APIError as e:
            result.http_status = e.status
            result.outcome = "rejected" if e.status in (429, 503) else "error"
            result.error = f"HTTP {e.status}: {e.message}"
            return
        pods = self.pods
        flow = _Flow(request_id, spec, prompt, result, decision,
                     pods[decision.prefill.address] if decision.prefill is not None else None,
                     pods[decision.decode.address], start, self.clock())
        self.flows[request_id] = flow
        asyncio.get_running_loop().call_later(self.serving.rpc_s, self._start_calls, flow, params)
        try:
            await flow.done
            if flow.refused is not None:
                result.outcome, result.error = "error", flow.refused
                return
            result.outcome = "cancelled" if flow.cancelled else "ok"
            result.http_status = 200
            result.num_output_tokens = result.num_chunks
        finally:
            if not flow.closed:           # timed out (cancelled by wait_for): abort on the pods
                self._close(flow, abort=True)

    def _start_calls(self, flow: _Flow, params: SamplingParams) -> None:
        if flow.closed:
            return
        rid, now = flow.request_id, self.clock()

        def add(pod: SimPod, remote: bool) -> None:
            if flow.closed:
                return
            request = Request(rid, list(flow.prompt), params, now)
            try:
                pod.scheduler.add_remote_request(request) if remote else pod.scheduler.add_request(request)
            except ValueError as e:   # the pod refuses it (too long for its pool): an error to the client
                flow.refused = str(e)
                self._close(flow, abort=True)
                if not flow.done.done():
                    flow.done.set_result(None)

        if flow.prefill is not None:
            flow.prefill.submit(lambda: add(flow.prefill, False))
            flow.decode.submit(lambda: add(flow.decode, True))
        else:
            flow.decode.submit(lambda: add(flow.decode, False))

    # ------------------------------------------------------------------ pods' steps
    def _on_step(self, pod: SimPod, out: SchedulerOutput, updated: list[Request]) -> None:
        flows, now = self.flows, self.clock()
        if pod.role == "prefill":
            bs = pod.scheduler.block_size
            for request in pod.scheduler.last_progressed:
                flow = flows.get(request.request_id)
                if flow is not None and request.num_computed_tokens < request.num_prompt_tokens:
                    flow.prefill_ready = request.num_computed_tokens // bs * bs
                    flow.pull_wake.set()
            for request in updated:               # first tokens: the prefill is done
                flow = flows.get(request.request_id)
                if flow is not None:
                    flow.prefill_done = True
                    flow.pull_wake.set()
                    asyncio.get_running_loop().call_at(now + self.serving.token_out_s, self._answered, flow)
                    self._token(flow, now, finished=flow.spec.max_tokens == 1, by_prefill=True)
            return
        for request_id in out.reserved_request_ids:
            flow = flows.get(request_id)
            if flow is not None and flow.pull is None:
                flow.pull = asyncio.get_running_loop().create_task(self._pull(flow))
        for request in updated:
            flow = flows.get(request.request_id)
            if flow is not None:
                self._token(flow, now, finished=request.is_finished)

    def _answered(self, flow: _Flow) -> None:
        """P's answer (its first token) reaches the router: P's load no longer counts the request."""
        if self.flows.get(flow.request_id) is flow and not flow.answered:
            flow.answered = True
            self.dispatcher.prefill_answered(flow.decision)

    async def _pull(self, flow: _Flow) -> None:
        """D's KV pull from P: what P has in full blocks, then the rest (`SimPod.pull_messages`:
        a message per KV group, windowed groups only from their window's start)."""
        serving, prefill, bs = self.serving, flow.prefill, self.shape.block_size
        await asyncio.sleep(serving.rpc_s)
        sent, total = 0, len(flow.prompt)
        while True:
            ready = -(-total // bs) if flow.prefill_done else flow.prefill_ready // bs    # blocks
            if ready > sent:
                messages, num_bytes = prefill.pull_messages(total, sent, ready)
                await asyncio.sleep(serving.kv_message_s * messages + num_bytes / serving.kv_bytes_per_s)
                sent = ready
                continue
            if flow.prefill_done:
                break
            flow.pull_wake.clear()
            await flow.pull_wake.wait()
        rid, decode, prefill = flow.request_id, flow.decode, flow.prefill
        decode.submit(lambda: decode.scheduler.remote_kv_landed(rid, SAMPLED_TOKEN_ID))
        prefill.submit(lambda: prefill.scheduler.release_request(rid))

    # ------------------------------------------------------------------ the client's view
    def _token(self, flow: _Flow, sampled_at: float, finished: bool, by_prefill: bool = False) -> None:
        """A token sampled at `sampled_at`; the client sees it `token_out_s` later."""
        if flow.closed:
            return
        at = sampled_at + self.serving.token_out_s
        if self.cpu_share is not None:
            self.cpu_share.serving_work(1)
        result = flow.result
        result.num_chunks += 1
        loop = asyncio.get_running_loop()
        if result.first_token_s is None:
            result.first_token_s = at - flow.start
            flow.first_at = at
            loop.call_at(at, self.dispatcher.observe_ttft, flow.decision, at - flow.routed_at)
        result.last_token_s = at - flow.start
        cancel = flow.spec.cancel_after_tokens
        if cancel is not None and result.num_chunks >= cancel and not finished:
            flow.cancelled = True
            self._end(flow, at, finished=False, abort=True)
        elif finished:
            # Ended by P's answer (one token): the router cuts D's call short, aborting on both pods.
            self._end(flow, at, finished=True, abort=by_prefill)

    def _end(self, flow: _Flow, at: float, finished: bool, abort: bool) -> None:
        """The stream ends at client time `at`: closed (and aborted, if cut short) at that instant."""
        flow.closed = True          # no more tokens count
        tokens = flow.result.num_chunks

        def end() -> None:
            if finished and flow.first_at is not None:
                self.dispatcher.observe_tpot(flow.decision, at - flow.first_at, tokens)
            self._close(flow, abort=abort)
            if not flow.done.done():
                flow.done.set_result(None)

        asyncio.get_running_loop().call_at(at, end)

    def _close(self, flow: _Flow, abort: bool) -> None:
        """Release the router's slots; cut short: abort on both pods (`rpc_s` later), stop the pull."""
        if self.flows.pop(flow.request_id, None) is None:
            return
        flow.closed = True
        self.dispatcher.release(flow.decision, flow.answered)
        if flow.pull is not None and not flow.pull.done():
            flow.pull.cancel()
        if abort:
            rid = flow.request_id
            for pod in {flow.prefill, flow.decode} - {None}:
                asyncio.get_running_loop().call_later(
                    self.serving.rpc_s, pod.submit, lambda p=pod: p.scheduler.abort_request(rid))
