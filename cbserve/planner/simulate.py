"""Predicted goodput rows: `bench/goodput.py`'s procedure, played on simulated clusters.

`sweep` mirrors `bench.goodput.run_config`: one cluster per configuration, warm-up requests, then
each rate in turn on the same cluster (its prefix caches and the router's models carry over), a
second's pause between rates, and the same stop once attainment falls below a floor. `at_rate`
is one rate on a fresh, warmed-up cluster (what the capacity search probes). Every run's requests
are the workload's own (`Mix.requests` / `Trace.requests`, the same seeds as the benchmark),
tokenized by the model's tokenizer, and each row is `summarize` of the client's results, so a
predicted row has exactly a measured row's fields.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from cbserve.goodput import prom
from cbserve.goodput.configs import parse_config
from cbserve.goodput.stats import RequestResult, Slo, summarize
from cbserve.goodput.workloads import RequestSpec
from cbserve.planner.sim_cluster import PodShape, ServingCosts, SimCluster
from cbserve.planner.sim_pod import Jitter, PodCosts
from cbserve.planner.virtual_loop import run_virtual

WARMUP_REQUESTS = 4        # bench/goodput.py's --warmup default
PAUSE_BETWEEN_RATES_S = 1.0


@dataclass(frozen=True)
class Run:
    """One simulated run: its row, the client's results, and each role's mean pod load."""

    row: dict
    results: list[RequestResult]
    load: dict[str, dict[str, float]]


@dataclass(frozen=True)
class SimModel:
    """What the simulator needs of a profile: step costs, serving costs, the pods' engine shape,
    and a tokenizer (`encode(text) -> ids`) for the workload's prompts."""

    pod_costs: PodCosts | dict[str, PodCosts]     # one for all pods, or one per role
    serving: ServingCosts
    shape: PodShape
    tokenizer: object
    request_timeout_s: float = 60.0
    jitter_sigma: float = 0.0          # the machine's slow stretches (`sim_pod.Jitter`)
    jitter_period_s: float = 1.0
    _encoded: dict = field(default_factory=dict, repr=False, compare=False)   # prompt -> ids

    def encode(self, requests: list[RequestSpec]) -> list[list[int]]:
        cache, encode = self._encoded, self.tokenizer.encode
        out = []
        for r in requests:
            ids = cache.get(r.prompt)
            if ids is None:
                ids = cache[r.prompt] = encode(r.prompt)
            out.append(ids)
        return out


def _row(cluster: SimCluster, results, elapsed: float, rate: float, duration_s: float, slo: Slo,
         before: prom.Samples, preemptions_before: int, steps_before: dict[str, tuple[float, int]]) -> dict:
    after = prom.parse(cluster.metrics.render().decode())
    queue_p95 = prom.histogram_quantile(0.95, prom.delta(after, before), "cbserve_request_phase_seconds",
                                        phase="router_queue")
    summary = summarize(results, rate=rate, duration_s=duration_s, elapsed_s=elapsed, slo=slo,
                        p95_router_queue_s=queue_p95, preemptions=cluster.num_preemptions - preemptions_before)
    steps = _step_totals(cluster)
    mean_step = {role: (busy - steps_before[role][0]) / (n - steps_before[role][1])
                 for role, (busy, n) in steps.items() if n > steps_before[role][1]}
    return summary.to_dict() | {"sample_errors": sorted({r.error for r in results if r.error})[:3],
                                "mean_step_s": mean_step, "latency_calibration": prom.latency_calibration(after)}


def _step_totals(cluster: SimCluster) -> dict[str, tuple[float, int]]:
    """role -> (seconds in steps, steps) over its pods, as the pods' step histograms sum them."""
    out: dict[str, tuple[float, int]] = {}
    for pod in cluster.pods.values():
        busy, n = out.get(pod.role, (0.0, 0))
        out[pod.role] = (busy + pod.busy_seconds, n + pod.stats.num_steps)
    return out


async def _play(model: SimModel, config: str, workload, rates: list[float], duration_s: float, seed: int,
                slo: Slo, warmup: int, stop_below_attainment: float, prefix_caching: bool | None,
                contention: dict[float, dict[str, float]] | None = None) -> list[Run]:
    caching = workload.prefix_caching if prefix_caching is None else prefix_caching
    cluster = SimCluster(parse_config(config), model.shape, model.pod_costs, model.serving, slo.ttft_s, slo.tpot_s,
                         caching, request_timeout_s=model.request_timeout_s,
                         jitter=Jitter(model.jitter_sigma, model.jitter_period_s, seed) if model.jitter_sigma else None,
                         seed=seed)
    try:
        await asyncio.sleep(0.2)           # the router's first load reports, as a cluster that just started
        if warmup:
            requests = workload.warmup(seed, warmup)
            await cluster.run(requests, model.encode(requests))
        runs = []
        for rate in rates:
            for pod in cluster.pods.values():     # a run's own contention (`sweep`): one factor, the whole step
                factor = (contention or {}).get(rate, {}).get(pod.role)
                if factor is not None:
                    pod.costs = replace(pod.costs, contention=factor, prefill_contention=None, row_s=0.0)
            requests = workload.requests(rate, duration_s, seed)
            before, preemptions = prom.parse(cluster.metrics.render().decode()), cluster.num_preemptions
            steps = _step_totals(cluster)
            cluster.reset_load()
            results, elapsed = await cluster.run(requests, model.encode(requests))
            row = {"mix": workload.name, "config": config,
                   **_row(cluster, results, elapsed, rate, duration_s, slo, before, preemptions, steps)}
            load = {role: cluster.mean_load(role) for role in ("prefill", "decode", "colocated")}
            runs.append(Run(row, results, {role: v for role, v in load.items() if v}))
            if row["slo_attainment"] < stop_below_attainment:
                break
            await asyncio.sleep(PAUSE_BETWEEN_RATES_S)
        return runs
    finally:
        cluster.close()


def sweep(model: SimModel, config: str, workload, rates: list[float], duration_s: float, seed: int, slo: Slo,
          warmup: int = WARMUP_REQUESTS, stop_below_attainment: float = 0.05,
          prefix_caching: bool | None = None, contention: dict[float, dict[str, float]] | None = None) -> list[dict]:
    """Rows for `config` at each of `rates` in turn on one cluster (the benchmark's procedure).
    `contention`: rate -> role -> factor, replacing the profile's for that rate's run (a check
    against a measurement can give each run the contention its pods measured): the whole of the
    step's wall per profiled second (a colocated pod's split by part, `PodCosts.seconds`, with it)."""
    return [run.row for run in sweep_runs(model, config, workload, rates, duration_s, seed, slo, warmup,
                                          stop_below_attainment, prefix_caching, contention)]


def sweep_runs(model: SimModel, config: str, workload, rates: list[float], duration_s: float, seed: int, slo: Slo,
               warmup: int = WARMUP_REQUESTS, stop_below_attainment: float = 0.05,
               prefix_caching: bool | None = None,
               contention: dict[float, dict[str, float]] | None = None) -> list[Run]:
    """`sweep`'s runs whole: each row with the client's results, request by request (what a
    measured run saved with `bench/goodput.py --save-requests` is compared with)."""
    return run_virtual(_play(model, config, workload, sorted(rates), duration_s, seed, slo, warmup,
                             stop_below_attainment, prefix_caching, contention))


def at_rate(model: SimModel, config: str, workload, rate: float, duration_s: float, seed: int, slo: Slo,
            warmup: int = WARMUP_REQUESTS, prefix_caching: bool | None = None) -> Run:
    """`config` at one rate, on a fresh cluster after the warm-up."""
    return run_virtual(_play(model, config, workload, [rate], duration_s, seed, slo, warmup, 0.0, prefix_caching))[0]


def load_tokenizer(model: str):
    """The model's tokenizer (a preset's is built without its weights)."""
    from engine.presets import resolve_model_dir
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(resolve_model_dir(model, create_weights=False))


def sim_model(profile, tokenizer=None, *, max_num_batched_tokens: int | None = None,
              max_num_seqs: int | None = None, step_scale: float = 1.0, overhead_scale: float = 1.0,
              request_timeout_s: float = 60.0, kv_cache_groups: str | None = None) -> SimModel:
    """The simulator's view of a `Profile` (knobs, `--kv-cache-groups` and sensitivity scales optional)."""
    serving = profile.serving
    return SimModel(profile.pod_costs(step_scale), profile.serving_costs(overhead_scale),
                    profile.shape(max_num_batched_tokens, max_num_seqs, kv_cache_groups),
                    tokenizer or load_tokenizer(profile.model_name), request_timeout_s,
                    serving.jitter_sigma if serving else 0.0, serving.jitter_period_s if serving else 1.0)


class NestedWorkload:
    """A workload whose every rate replays the first requests of one draw, arrivals compressed.

    The capacity search compares rates: with a fresh draw per rate (the benchmark's way) the
    attainment of neighbouring rates differs by the draws as much as by the rate, and a bisection
    on it wanders. Here the requests at rate r over D seconds are the first round(r x D) of one
    draw at 1 req/s, arrival times divided by r: still a Poisson process (with the mix's bursts and
    cancellations), and a higher rate offers the same requests closer together."""

    def __init__(self, workload) -> None:
        self.workload = workload
        self.name = workload.name
        self.prefix_caching = workload.prefix_caching
        self._base: list[RequestSpec] = []
        self._seed: int | None = None

    def warmup(self, seed: int, count: int) -> list[RequestSpec]:
        return self.workload.warmup(seed, count)

    def requests(self, rate: float, duration_s: float, seed: int) -> list[RequestSpec]:
        count = max(1, round(rate * duration_s))
        if self._seed != seed or len(self._base) < count:
            length = 64.0
            while length < count * 1.05 + 16:
                length *= 2
            self._base, self._seed = self.workload.requests(1.0, length, seed), seed
        return [replace(r, arrival_s=r.arrival_s / rate) for r in self._base[:count]]
