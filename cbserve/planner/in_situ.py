"""`cbserve profile`, stage B: what serving adds to the engine's steps, from a short real run.

A real cluster (`LocalCluster`, one prefill and one decode pod with the profiled engine flags and
thread count, the router with SLOs so loose that it admits everything: this measures the machine,
not the policy) takes two kinds of traffic, and the simulator replays the same requests on the
stage-A cost model to see what the engine alone would take:
1. probes, one request at a time: prompts of three lengths, 2 and 24 tokens out. TTFT minus the
   simulated prefill is the request path's overhead (HTTP, router, RPCs, first-token path); a
   2-token answer's TPOT is the P->D hand-over, whose growth with the prompt gives the KV
   bandwidth and whose intercept the per-pull latency; a 24-token answer's TPOT gives each decode
   step's wall time, of which what the step model does not explain is the pod's loop gap;
2. a load run on the calibration mix with the busiest pod busy about 60% of the time: the factor
   on the profiled step cost at which the simulated run's mean step is each pod's measured one (its
   `cbserve_step_seconds` histogram) is that role's contention factor (a fixed point: a slower step
   grows the batches, so the measured mean over the simulated one at factor 1 overshoots): two
   pods, the router and the client sharing the machine's cores (and, on a shared machine, the
   neighbours). The same cluster then takes `long-output` with the decode pod at about 12 rows a
   step (a decode row's own cost, `_fit_decode`) and `long-prompt` with the prefill pod busy about
   60% of the time (the prefill factor, `_fit_prefill`: the calibration run's prefill pod is idle
   nine tenths of the time, and its factor was twice the knee's); a colocated-2 cluster takes the
   same kind of run, then one near its knee (pods busy `high_busy` of the time): plans step a
   colocated pod's decode rows at the decode factor and its prefill chunks at the prefill factor
   (`sim_pod.PodCosts.seconds`), and the two runs check that (`_colocated_check`; their own one
   factor, kept as `colocated_contention`, falls as the steps take more prefill); a colocated-1
   cluster takes the calibration run and a `long-prompt` run for a lone pod's factors (`_fit_alone`):
   a step is slower while another engine steps on another core (measured: a colocated-1 pod's
   steps at 0.8-1.3x the profiled cost, a colocated-2 pod's at about 1.8x, both all CPU time, so
   not a share of the cores but the caches and memory both engines use), so a one-pod cluster
   is not planned at a two-pod cluster's factor.
Then the load run is simulated with the contention factors: what its measured TPOT median has
beyond the simulated one is each decode step's loop gap, what its TTFT median has beyond, a longer
request path under load; a last simulation with everything gives the calibration's own residual
(reported, and part of a plan's uncertainty; the workloads a plan is judged on are other ones).
The raw measurements stay in the profile (`in_situ_raw`), so `fit_in_situ` can refit them.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from cbserve.cluster_spec import ClusterSpec
from cbserve.goodput import cpu, prom
from cbserve.goodput.loadgen import run_open_loop
from cbserve.goodput.stats import RequestResult, percentile
from cbserve.goodput.workloads import MIXES, RequestSpec, random_text
from cbserve.local_cluster import LocalCluster
from cbserve.planner.profile import Profile, ServingProfile, with_serving
from cbserve.planner.sim_cluster import SimCluster
from cbserve.planner.sim_pod import Jitter
from cbserve.planner.simulate import sim_model
from cbserve.planner.virtual_loop import run_virtual
from engine.telemetry.step_shape import StepShape

LOOSE_SLO_MS = 600_000.0        # the router admits everything: the run measures the machine
PROBE_OUTPUTS = (2, 24)


@dataclass(frozen=True)
class InSituSettings:
    seconds: float = 20.0           # the load run's arrivals
    probe_repeats: int = 3
    mix: str = "chat"               # the calibration workload
    seed: int = 0
    target_busy: float = 0.6        # the load run's rate: this share of the busiest pod's time
    high_busy: float = 0.95         # the colocated-2 cluster's second run: near its knee
    rows_mix: str = "long-output"   # the 1P+1D cluster's second run: its decode pod batching many rows
    target_rows: float = 12.0       # ... at the rate giving the simulated decode pod this many rows a step
    prefill_mix: str = "long-prompt"    # its third run: the prefill pod's factor, where it has work
    prefill_busy: float = 0.6       # ... at the rate keeping the simulated prefill pod this busy


def probe_requests(profile: Profile, repeats: int, seed: int) -> list[RequestSpec]:
    """One request at a time: arrival gaps of a generous multiple of each one's predicted time."""
    engine, model = profile.engine, profile.cost_model
    longest = min(engine["max_num_batched_tokens"], engine["max_model_len"] - 64) - 16
    lengths = sorted({32, max(33, longest // 2), max(34, longest)})
    rng = random.Random(f"{seed}:probes")
    shapes = [(n, m) for _ in range(repeats) for n in lengths for m in PROBE_OUTPUTS]
    rng.shuffle(shapes)
    out, t = [], 0.0
    for i, (n, m) in enumerate(shapes):
        out.append(RequestSpec(i, t, random_text(rng, n - 1), m))
        prefill = model.seconds(StepShape(0, 0, prefill_chunks=((n, 0),), num_sampled=1))
        decode = model.seconds(StepShape(1, n, n, n, num_sampled=1))
        t += 4 * (prefill + m * decode) + 0.3
    return out


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope); a flat line when x does not vary."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return my - slope * mx, slope


PD = {"num_prefill": 1, "num_decode": 1, "policy": "goodput"}
COLOCATED = {"num_colocated": 2, "policy": "goodput"}
ALONE = {"num_colocated": 1, "policy": "goodput"}


def _simulate(profile: Profile, requests: list[RequestSpec], fields: dict = PD, rows: dict | None = None):
    """The requests on a simulated cluster (1P+1D by default): (results, {role: (busy seconds, steps)});
    `rows`, if given, gets each role's decode rows summed over its steps, each times its step's
    scale (`SimPod.scaled_rows`)."""
    model = sim_model(profile)

    async def play():
        jitter = Jitter(model.jitter_sigma, model.jitter_period_s) if model.jitter_sigma else None
        cluster = SimCluster(fields, model.shape, model.pod_costs, model.serving, LOOSE_SLO_MS / 1000,
                             LOOSE_SLO_MS / 1000, False, jitter=jitter)
        try:
            await asyncio.sleep(0.2)
            results, _ = await cluster.run(requests, model.encode(requests))
            steps: dict[str, tuple[float, int]] = {}
            for p in cluster.pods.values():
                busy, n = steps.get(p.role, (0.0, 0))
                steps[p.role] = (busy + p.busy_seconds, n + p.stats.num_steps)
                if rows is not None:
                    rows[p.role] = rows.get(p.role, 0.0) + p.scaled_rows
            return results, steps
        finally:
            cluster.close()
    return run_virtual(play())


def _fit_probes(profile: Profile, probes: list[RequestSpec], measured: list[RequestResult]) -> dict:
    """From requests alone on the cluster: the request path's overhead and the P->D hand-over.

    TTFT = overhead + c_p x (the simulated prefill) over three prompt lengths gives both (c_p: the
    prefill pod's contention when alone); a 24-token answer's steps give the decode pod's (c_d);
    a 2-token answer's TPOT (the hand-over) minus c_d x its simulated first decode step is the KV
    transfer, linear in the prompt's tokens: a per-pull latency and bytes per second."""
    simulated, _ = _simulate(with_serving(profile, ServingProfile()), probes)
    ok = [(p, m, s) for p, m, s in zip(probes, measured, simulated)
          if m.outcome == "ok" and s.outcome == "ok" and m.ttft_s is not None and m.tpot_s is not None]
    if len(ok) < len(probes) // 2:
        raise RuntimeError(f"only {len(ok)} of {len(probes)} probe requests finished; see the cluster's logs")
    overhead, prefill_contention = _fit_line([s.ttft_s for _, _, s in ok], [m.ttft_s for _, m, _ in ok])
    long = [(p, m, s) for p, m, s in ok if p.max_tokens > 2]
    short = [(p, m, s) for p, m, s in ok if p.max_tokens == 2]
    # A 24-token answer's 23 gaps are the hand-over and 22 steps; the hand-over is the 2-token
    # answers' (fitted at the decode contention), the steps' share gives the decode contention:
    # a fixed point, reached in a few rounds. (The simulated answer alone: one step per gap.)
    decode_contention, intercept, slope = 1.0, 0.0, 0.0
    for _ in range(4):
        handover = [(len(p.prompt) + 1, m.tpot_s - decode_contention * s.tpot_s) for p, m, s in short]
        if handover:
            intercept, slope = _fit_line([float(n) for n, _ in handover], [g for _, g in handover])
        ratios = []
        for p, m, s in long:
            gaps = p.max_tokens - 1
            handover_s = intercept + slope * (len(p.prompt) + 1) + decode_contention * s.tpot_s
            ratios.append((gaps * m.tpot_s - handover_s) / (gaps - 1) / s.tpot_s)
        if ratios:
            decode_contention = statistics.median(ratios)
    return {"probes": len(ok), "ttft_overhead_s": max(0.0, overhead), "prefill_contention_alone": prefill_contention,
            "decode_contention_alone": decode_contention, "handover_intercept_s": intercept,
            "handover_s_per_token": slope}


def _serving_from_probes(fit: dict, kv_bytes_per_token: int) -> ServingProfile:
    """The request path split in four (a quarter to the router, a quarter on to the pod, half back
    to the client) and the KV pull's per-message latency and bandwidth. The pull opens long before
    P is done (D reserves as the request arrives) and both first tokens take the same way back,
    so what the hand-over adds beyond D's step is the transfer alone."""
    overhead = fit["ttft_overhead_s"]
    slope = fit["handover_s_per_token"]
    return ServingProfile(http_in_s=overhead / 4, rpc_s=overhead / 4, token_out_s=overhead / 2,
                          kv_message_s=max(0.0, fit["handover_intercept_s"]),
                          kv_bytes_per_s=kv_bytes_per_token / slope if slope > 0 else float("inf"))


def _engine_cpu(cpu_seconds: dict[str, float], step_seconds: dict, threads: dict | None) -> float:
    """What the pods' engine threads used in one load run: each pod's engine thread's CPU where
    the run recorded it by thread (`cpu.thread_split`), else the pods' seconds in steps (their
    `cbserve_step_seconds`: a step's wall time, of which the CPU is at most the pod's)."""
    if threads:
        return sum(t.get("engine", 0.0) for t in threads.values())
    pods = sum(v for k, v in cpu_seconds.items() if k not in ("client", "router", "wall"))
    return min(pods, sum(total for total, _ in step_seconds.values()))


def serving_cpu_seconds(cpu_seconds: dict[str, float], step_seconds: dict, threads: dict | None) -> float:
    """The serving path's CPU seconds in one run: every process's CPU (router, pods, the client)
    less what the pods' engine threads took (`cpu_share`: the steps' own excess over the profile
    is their role's contention, not serving work)."""
    total = sum(v for k, v in cpu_seconds.items() if k != "wall")
    return max(0.0, total - _engine_cpu(cpu_seconds, step_seconds, threads))


def _serving_cpu(results: list[RequestResult], cpu_seconds: dict[str, float], step_seconds: dict,
                 threads: dict | None) -> tuple[float, int]:
    """(CPU seconds of the serving path, tokens streamed) in one load run."""
    return serving_cpu_seconds(cpu_seconds, step_seconds, threads), sum(r.num_output_tokens for r in results)


def _fit_cpu(profile: Profile, raw: dict, settings: InSituSettings, serving: ServingProfile) -> ServingProfile:
    """The cores the in-situ processes shared and the serving path's CPU (`_serving_line`: a base
    in cores and a cost per streamed token), from each load run's process CPU seconds: the 1P+1D
    runs' for disaggregated clusters, the colocated-2 runs' for colocated ones (profiles made
    before they were recorded: no sharing)."""
    device = profile.data.get("device", {})
    if device.get("type") != "cpu":     # the host's cores are not what a device's steps wait for
        return serving
    disaggregated = _serving_line([raw, raw.get("decode_high"), raw.get("prefill_high")])
    colocated = _serving_line([raw.get("colocated"), raw.get("colocated_high")])
    if disaggregated is None and colocated is None:
        return serving
    base, per_token = disaggregated or colocated
    return replace(serving, cores=float(device.get("cpu_count") or 1), cpu_per_token_s=per_token, serving_cores=base,
                   colocated_cpu_per_token_s=colocated[1] if colocated else None,
                   colocated_serving_cores=colocated[0] if colocated else None)


def _serving_line(runs: list[dict | None]) -> tuple[float, float] | None:
    """(cores, CPU seconds per streamed token) of the serving path over the load runs of one kind
    of cluster that recorded their CPU: the line `CPU / wall = cores + per token x tokens / wall`
    through them (`_fit_line`); with one run (older profiles), or a term the runs put below 0, the
    line through the origin (no base). Why a base: its idle timers (the router's load reports
    every 50 ms, the pods' loops) cost CPU whatever the traffic, so one run's CPU per token, stage
    B's calibration run's 1.8 ms at 178 tokens/s (tiny, session 13), is 5x what its `long-output`
    run used per token at 2044 tokens/s, and a simulated cluster near its knee wanted cores it
    does not use."""
    points = []     # (tokens, CPU seconds) per second of each run
    for run in runs:
        if not run or not run.get("cpu_seconds") or run.get("load_rate") is None or not run["cpu_seconds"].get("wall"):
            continue
        c, n = _serving_cpu([RequestResult(**r) for r in run.get("load", [])], run["cpu_seconds"],
                            run.get("step_seconds", {}), run.get("cpu_threads"))
        wall = float(run["cpu_seconds"]["wall"])
        points.append((n / wall, c / wall))
    if not any(n for n, _ in points):
        return None
    if len(points) >= 2:
        base, per_token = _fit_line([n for n, _ in points], [c for _, c in points])
        if base >= 0 and per_token > 0:
            return base, per_token
    return 0.0, sum(n * c for n, c in points) / sum(n * n for n, _ in points)


HIGHER_RATE = 1.2              # the colocated runs' rates after the first: a finer ladder above it
FIXED_POINT_ROUNDS = 8          # simulations at most per fitted set of factors
FIXED_POINT_TOLERANCE = 0.01    # every simulated mean step within 1% of its measured one


def fixed_point(measured: dict[str, float], simulate: Callable[[dict[str, float]], dict[str, float]],
                 start: dict[str, float]) -> dict[str, float]:
    """The factors (one per name in `start`) at which `simulate(factors)`, each name's simulated
    mean step, is the `measured` one.

    A slower step makes batches grow, which makes the mean step longer still, so one ratio
    measured / simulated at a trial factor overshoots (session 8's colocated run: 2.04 at 1.0,
    where about 1.8 reproduces it). So f <- f x measured / simulated(f), round after round, until
    each name is within `FIXED_POINT_TOLERANCE`. The rounds alternate around the fixed point
    (growing batches make the next ratio smaller than the last), and near saturation they would
    swing wider: each name keeps the bracket its rounds have shown (a factor whose simulated step
    came out short is below the fixed point, long above), and a step that would leave it goes to
    the bracket's geometric middle instead. Names absent from `measured` keep their factor."""
    factors = dict(start)
    lower = dict.fromkeys(measured, 0.0)
    upper = dict.fromkeys(measured, math.inf)
    for _ in range(FIXED_POINT_ROUNDS):
        simulated = simulate(factors)
        ratios = {k: m / simulated[k] for k, m in measured.items() if simulated.get(k)}
        if all(abs(r - 1.0) <= FIXED_POINT_TOLERANCE for r in ratios.values()):
            break
        for k, ratio in ratios.items():
            if abs(ratio - 1.0) <= FIXED_POINT_TOLERANCE:
                continue        # this one is there (an exact 1 would set its upper end and go to 0)
            f = factors[k]
            if ratio > 1.0:
                lower[k] = max(lower[k], f)
            else:
                upper[k] = min(upper[k], f)
            proposal = f * ratio
            # Outside the bracket only when both its ends are known (the step moves off the
            # end it just set), so the middle is finite.
            factors[k] = proposal if lower[k] < proposal < upper[k] else math.sqrt(lower[k] * upper[k])
    return factors


def _step_mean(steps: dict[str, tuple[float, float]], role: str) -> float | None:
    """A role's mean step from its (seconds, steps) totals; None without steps."""
    total, count = steps.get(role, (0.0, 0))
    return total / count if count and total else None


def _fit_contention(profile: Profile, load: list[RequestSpec], measured_steps: dict[str, tuple[float, float]],
                    serving: ServingProfile) -> ServingProfile:
    """The decode and prefill factors at which the simulated 1P+1D run's mean steps are the
    measured ones (`fixed_point`, from the current factors)."""
    measured = {role: m for role in ("decode", "prefill") if (m := _step_mean(measured_steps, role))}

    def simulate(factors: dict[str, float]) -> dict[str, float]:
        trial = replace(serving, contention=factors["decode"], prefill_contention=factors["prefill"])
        _, steps = _simulate(with_serving(profile, trial), load)
        return {role: m for role in factors if (m := _step_mean(steps, role))}

    factors = fixed_point(measured, simulate, {"decode": serving.contention, "prefill": serving.prefill_contention})
    return replace(serving, contention=factors["decode"], prefill_contention=factors["prefill"])


def _decode_terms(profile: Profile, requests: list[RequestSpec], serving: ServingProfile) -> tuple[float, float, float]:
    """The simulated 1P+1D run's decode pod at `serving`, per step: (profiled seconds, decode
    rows, wall seconds), the first two each times its step's scale, so that the wall is
    `contention` x the first + `decode_row_s` x the second."""
    rows: dict[str, float] = {}
    _, steps = _simulate(with_serving(profile, serving), requests, rows=rows)
    busy, n = steps.get("decode", (0.0, 0))
    if not n:
        return 0.0, 0.0, 0.0
    profiled = (busy - serving.decode_row_s * rows.get("decode", 0.0)) / serving.contention
    return profiled / n, rows.get("decode", 0.0) / n, busy / n


def _fit_decode(profile: Profile, load: list[RequestSpec], measured_steps: dict[str, tuple[float, float]],
                high: dict | None, settings: InSituSettings, serving: ServingProfile,
                prefill: dict | None = None) -> ServingProfile:
    """The 1P+1D factors (`_fit_contention`) and, where stage B ran the decode pod at many rows a
    step too (`raw["decode_high"]`), a decode row's own cost: `contention` x profiled +
    `decode_row_s` x rows reproducing both runs' mean decode steps; then the prefill factor
    (`_fit_prefill`: on `raw["prefill_high"]` where stage B ran it).

    Why: tiny's decode factor grew with the batch (engine CPU over profiled 1.17 at 1.7 rows,
    1.66-1.82 at 12-20 rows; session 10, u39), so one factor fitted where stage B's `chat` run
    holds 1-2 rows a step made the knee's decode steps short and its 1P+1D goodput 16-28% high.
    Two runs at different batches tell the two apart (`_fit_row_cost`). A row cost the two runs
    put below 0 (the factor falling with the batch) is not modelled: 0 and the first run's
    factor, as before."""
    serving = _fit_contention(profile, load, measured_steps, replace(serving, decode_row_s=0.0))
    low_step, high_steps = _step_mean(measured_steps, "decode"), (high or {}).get("step_seconds")
    high_step = _step_mean(high_steps, "decode") if high_steps else None
    if low_step and high_step:
        serving = _fit_row_cost(profile, load, low_step, _run_requests(high, settings), high_step, serving)
    return _fit_prefill(profile, *_two_runs(load, measured_steps, prefill, settings)[-1], serving)


def _fit_row_cost(profile: Profile, load: list[RequestSpec], low_step: float, requests: list[RequestSpec],
                  high_step: float, serving: ServingProfile) -> ServingProfile:
    """`_fit_decode`'s two-run fit of the decode factor and row cost: the row cost by bisection,
    each trial's factor from the calibration run's linear equation (`low_step` = factor x profiled
    + row cost x rows, at that trial's simulated per-step terms: a row or two a step, so its batch
    barely moves), until the many-rows run's simulated mean step is `high_step` (`serving`
    unchanged where the row cost 0 already reaches it: the factor does not grow with the batch).

    Bisection, not the two equations solved round after round (sessions 11-12): near the many-rows
    run's knee a longer step grows its batch, which lengthens the step again, so a solve at one
    round's batch overshoots into saturation (tiny, session 13: 0.52 ms a row at 15 rows a step
    put 50 rows in a step and the step at 32 ms, against 12.8 measured) and the rounds swung
    between the two; the simulated step grows with the row cost, so a bracket closes on it."""

    def trial(row_s: float) -> tuple[ServingProfile, float] | None:
        profiled, rows, _ = _decode_terms(profile, load, replace(serving, decode_row_s=row_s))
        contention = (low_step - row_s * rows) / profiled if profiled else 0.0
        if contention <= 0:
            return None
        candidate = replace(serving, contention=contention, decode_row_s=row_s)
        return candidate, _decode_terms(profile, requests, candidate)[2]

    start = trial(0.0)
    if start is None or start[1] >= high_step * (1 - FIXED_POINT_TOLERANCE):
        return serving
    rows = _decode_terms(profile, requests, start[0])[1]
    low, high = 0.0, high_step / rows if rows else 0.0     # the whole step as row cost: above it
    best = start
    for _ in range(2 * FIXED_POINT_ROUNDS):
        middle = (low + high) / 2
        result = trial(middle)
        if result is None or result[1] > high_step:
            high = middle
        else:
            low = middle
        if result is not None and abs(result[1] / high_step - 1) < abs(best[1] / high_step - 1):
            best = result
        if abs(best[1] / high_step - 1) <= FIXED_POINT_TOLERANCE:
            break
    return best[0]


def _run_requests(run: dict, settings: InSituSettings) -> list[RequestSpec]:
    """The requests of one of stage B's load runs as `raw` keeps it (its `mix`; runs stored
    without one, the calibration mix's)."""
    return MIXES[run.get("mix", settings.mix)].requests(run["load_rate"], settings.seconds, settings.seed)


def _two_runs(load: list[RequestSpec], measured_steps: dict, run: dict | None,
              settings: InSituSettings) -> list[tuple[list[RequestSpec], dict]]:
    """(requests, measured steps) of the calibration run, then of `run` (`raw["decode_high"]` or
    `raw["prefill_high"]`) where stage B took it: the runs a factor is fitted or checked on."""
    runs = [(load, measured_steps)]
    if run and run.get("step_seconds"):
        runs.append((_run_requests(run, settings), {r: tuple(v) for r, v in run["step_seconds"].items()}))
    return runs


def _fit_prefill(profile: Profile, requests: list[RequestSpec], measured_steps: dict,
                 serving: ServingProfile) -> ServingProfile:
    """The prefill factor at which the simulated run of `requests` has its measured mean prefill
    step, the decode pod's costs held (`fixed_point`; `serving` unchanged without prefill steps).

    Fitted on stage B's third run (`prefill_mix` with the prefill pod `prefill_busy` of the time),
    not on the calibration run, whose prefill pod is idle nine tenths of the time: there its 39
    steps in 20 s gave 2.34 and 2.05 (the same requests, minutes apart; `chat` without bursts 1.86),
    where 256-token prompts gave 1.69 at 3 req/s, 1.44 at 6 and 1.33 at 9, and long prompts 1.58
    (tiny, session 13): the knee's prefill pod stepped at half the factor the calibration run gave
    it, and its goodput came out up to 30% low (session 11)."""
    if (measured := _step_mean(measured_steps, "prefill")) is None:
        return serving

    def simulate(factors: dict[str, float]) -> dict[str, float]:
        _, steps = _simulate(with_serving(profile, replace(serving, prefill_contention=factors["prefill"])), requests)
        return {"prefill": m} if (m := _step_mean(steps, "prefill")) else {}

    factors = fixed_point({"prefill": measured}, simulate, {"prefill": serving.prefill_contention})
    return replace(serving, prefill_contention=factors["prefill"])


def _prefill_check(profile: Profile, load: list[RequestSpec], measured_steps: dict, prefill: dict | None,
                   settings: InSituSettings, serving: ServingProfile) -> list[dict]:
    """Each 1P+1D run the prefill factor is fitted or checked on (`_two_runs`): its measured
    mean prefill step, the simulated one at the fitted costs, and the run's own factor."""
    out = []
    for requests, steps in _two_runs(load, measured_steps, prefill, settings):
        measured = _step_mean(steps, "prefill")
        if measured is None:
            continue
        _, simulated = _simulate(with_serving(profile, serving), requests)
        out.append({"measured_step_s": measured, "simulated_step_s": _step_mean(simulated, "prefill"),
                    "factor": _fit_prefill(profile, requests, steps, serving).prefill_contention})
    return out


def _decode_check(profile: Profile, load: list[RequestSpec], measured_steps: dict, high: dict | None,
                  settings: InSituSettings, serving: ServingProfile) -> list[dict]:
    """Each 1P+1D run's measured mean decode step, the simulated one at the fitted costs, the
    simulated decode rows a step, and the run's own one factor (no row cost; the first run's is
    `_fit_contention`'s, the second's its own fixed point)."""
    single = replace(serving, decode_row_s=0.0)
    out = []
    for requests, steps in _two_runs(load, measured_steps, high, settings):
        measured = _step_mean(steps, "decode")
        if measured is None:
            continue
        _, rows, simulated = _decode_terms(profile, requests, serving)

        def simulate(factors: dict[str, float], requests=requests) -> dict[str, float]:
            return {"decode": _decode_terms(profile, requests, replace(single, contention=factors["decode"]))[2]}

        factor = fixed_point({"decode": measured}, simulate, {"decode": serving.contention})["decode"]
        out.append({"measured_step_s": measured, "simulated_step_s": simulated, "rows_per_step": rows,
                    "factor": factor})
    return out


def _fit_colocated_contention(profile: Profile, requests: list[RequestSpec], fields: dict, field: str,
                              measured_steps: dict[str, tuple[float, float]],
                              serving: ServingProfile) -> ServingProfile:
    """`field` (`colocated_contention`, `alone_contention`, `alone_prefill_contention`): the factor
    at which the colocated cluster `fields`, simulated on `requests`, has the measured mean step
    (`fixed_point` from the field's value in `serving`, 1.0 where it has none: then its first round
    is the one ratio at 1.0 that sessions up to 8 stopped at)."""
    measured = _step_mean(measured_steps, "colocated")
    if measured is None:
        return serving

    def simulate(factors: dict[str, float]) -> dict[str, float]:
        _, steps = _simulate(with_serving(profile, replace(serving, **{field: factors[field]})), requests, fields)
        mean = _step_mean(steps, "colocated")
        return {field: mean} if mean else {}

    return replace(serving, **fixed_point({field: measured}, simulate, {field: getattr(serving, field) or 1.0}))


def _fit_alone(profile: Profile, alone: dict, prefill: dict | None, settings: InSituSettings,
               serving: ServingProfile) -> tuple[ServingProfile, list[dict]]:
    """A one-pod cluster's factors: one (`alone_contention`) from its calibration-mix run; where
    stage B ran it on `prefill_mix` too, its steps split like a colocated pair's (the decode part at
    `alone_contention`, the prefill part at `alone_prefill_contention`), each factor fitted on the
    run whose steps it dominates, in turns (each fixed point moves the other run a little). And
    each run's measured and simulated mean step.

    Why: one factor fitted on `chat` (0.64, a step a few decode rows) put tiny's lone pod at 41 req/s
    of fixed-256-64 where it collapsed past 20-24 (session 13): its 256-token prefills stepped at
    the decode rows' factor; each fixed-256-64 row's own factor was 0.89-1.22. The factors are fitted
    with the pod paying `decode_row_s` a decode row (`serving.alone_rows`), the 1P+1D runs' host work
    per row: session 19 found the lone pod's knee steps longer than one factor from stage B's few-row
    steps says (fixed-256-64 at 12-16 req/s predicted 18-25% high; with the row cost 1-16%)."""
    serving = replace(serving, alone_rows=True)
    runs = [(_run_requests(alone, settings), alone["step_seconds"])]
    if prefill and prefill.get("step_seconds"):
        runs.append((_run_requests(prefill, settings), prefill["step_seconds"]))
        serving = replace(serving, alone_prefill_contention=serving.alone_prefill_contention or 1.0)
    else:
        serving = replace(serving, alone_prefill_contention=None)
    for _ in range(3 if len(runs) > 1 else 1):
        serving = _fit_colocated_contention(profile, runs[0][0], ALONE, "alone_contention", runs[0][1], serving)
        if len(runs) > 1:
            serving = _fit_colocated_contention(profile, runs[1][0], ALONE, "alone_prefill_contention", runs[1][1],
                                                serving)
    check = []
    for requests, steps in runs:
        _, simulated = _simulate(with_serving(profile, serving), requests, ALONE)
        check.append({"measured_step_s": _step_mean(steps, "colocated"),
                      "simulated_step_s": _step_mean(simulated, "colocated")})
    return serving, check


def _colocated_check(profile: Profile, settings: InSituSettings, runs: list[dict],
                     serving: ServingProfile) -> list[dict]:
    """Each colocated-2 run (`raw["colocated"]`, and `raw["colocated_high"]` near the knee where
    stage B took it): its measured mean step, the simulated one with the steps split by part
    (`serving.colocated_split`, what plans use) and its own one-factor fixed point.

    Why the split: one colocated factor is right only for the mix of decode and prefill work it
    was fitted on. Small int8's pair measured 1.23-1.37 on `chat` at stage B's load and 1.01-1.14
    on fixed-256-64 at 2.25-3 req/s (more prefill per step); its decode rows at the 1P+1D run's
    decode factor (1.27-1.45) and its prefill chunks at the prefill factor (0.59-0.72) give both
    runs' mean steps within 10% and every knee row's goodput within 5% (sessions 9 and 10)."""
    out = []
    single = replace(serving, colocated_split=False)
    for i, run in enumerate(runs):
        measured = _step_mean(run["step_seconds"], "colocated")
        if measured is None:
            continue
        requests = _run_requests(run, settings)
        # The first run's one factor is the profile's `colocated_contention`, fitted on it already.
        factor = serving.colocated_contention if i == 0 else _fit_colocated_contention(
            profile, requests, COLOCATED, "colocated_contention", run["step_seconds"], single).colocated_contention
        _, steps = _simulate(with_serving(profile, serving), requests, COLOCATED)
        out.append({"load_rate": run["load_rate"], "measured_step_s": measured,
                    "simulated_step_s": _step_mean(steps, "colocated"), "factor": factor})
    return out


def _fit_medians(profile: Profile, load: list[RequestSpec], measured: dict[str, float],
                 serving: ServingProfile) -> ServingProfile:
    """The loop gap that brings the simulated TPOT median to the measured one, then the longer
    request path that does the same for TTFT."""
    simulated, _ = _simulate(with_serving(profile, replace(serving, step_gap_s=0.0)), load)
    gap = max(0.0, measured.get("tpot_s", 0.0) - _medians(simulated).get("tpot_s", 0.0))
    serving = replace(serving, step_gap_s=gap)
    simulated, _ = _simulate(with_serving(profile, serving), load)
    extra = measured.get("ttft_s", 0.0) - _medians(simulated).get("ttft_s", 0.0)
    if extra > 0:
        serving = replace(serving, http_in_s=serving.http_in_s + extra / 2, token_out_s=serving.token_out_s + extra / 2)
    return serving


# Wider spreads would, at no load, already make a share of requests miss a TPOT SLO set at a few
# times the median, which the measured runs do not show: the spread of a 20 s run's TPOT also has
# causes the jitter stands in for badly (batches growing and shrinking), so it is capped.
JITTER_SIGMAS = (0.0, 0.1, 0.2, 0.3, 0.4)


def _tpot_tail(results: list[RequestResult]) -> float:
    """log(p90 / p50) of TPOT: how wide its spread across requests is, whatever its level (a
    request's TPOT averages its steps, so only stretches of seconds widen it)."""
    values = [r.tpot_s for r in results if r.outcome == "ok" and r.tpot_s]
    p50, p90 = percentile(values, 50), percentile(values, 90)
    return math.log(p90 / p50) if p50 and p90 else 0.0


def _fit_jitter(profile: Profile, load: list[RequestSpec], measured: list[RequestResult],
                serving: ServingProfile) -> ServingProfile:
    """The jitter spread whose simulated TPOT tail is closest to the measured one."""
    target = _tpot_tail(measured)
    best, best_error = 0.0, math.inf
    for sigma in JITTER_SIGMAS:
        simulated, _ = _simulate(with_serving(profile, replace(serving, jitter_sigma=sigma)), load)
        error = abs(_tpot_tail(simulated) - target)
        if error < best_error:
            best, best_error = sigma, error
    return replace(serving, jitter_sigma=best)


def _medians(results: list[RequestResult]) -> dict[str, float]:
    out = {}
    for name in ("ttft_s", "tpot_s"):
        values = [getattr(r, name) for r in results if r.outcome == "ok" and getattr(r, name) is not None]
        if values:
            out[name] = statistics.median(values)
    return out


def _step_means(pod_samples: dict[str, prom.Samples]) -> dict[str, tuple[float, float]]:
    """role -> (sum, count) of its pods' cbserve_step_seconds over the run."""
    out: dict[str, tuple[float, float]] = {}
    for role, samples in pod_samples.items():
        out[role] = (prom.total(samples, "cbserve_step_seconds_sum"), prom.total(samples, "cbserve_step_seconds_count"))
    return out


def _load_rate(profile: Profile, settings: InSituSettings, fields: dict = PD, target_busy: float | None = None,
               start: float = 0.125, growth: float = 1.5, mix: str | None = None, role: str | None = None) -> float:
    """The highest rate of `start` x `growth`^k (k < 10; `start` if none) at which the simulated
    busiest pod (`role`'s, if given) is busy at most `target_busy` (the settings') of the time, on
    `mix` (the settings' calibration mix if None)."""
    target_busy = settings.target_busy if target_busy is None else target_busy
    workload = MIXES[mix or settings.mix]
    rate = start
    chosen = rate
    pods = fields.get("num_colocated") or 1
    for _ in range(10):
        requests = workload.requests(rate, min(settings.seconds, 20.0), settings.seed)
        results, steps = _simulate(profile, requests, fields)
        elapsed = max((r.done_s or 0.0) for r in results)
        seconds = steps.get(role, (0.0, 0))[0] if role else max(b for b, _ in steps.values())
        busy = seconds / pods / max(elapsed, 1e-9)
        if busy > target_busy:
            break
        chosen = rate
        rate *= growth
    return chosen


def _rows_rate(profile: Profile, settings: InSituSettings, start: float, growth: float = HIGHER_RATE) -> float:
    """The lowest rate of `start` x `growth`^k (k < 24) at which the simulated 1P+1D cluster's
    decode pod, on `settings.rows_mix`, steps at least `settings.target_rows` rows a step on the
    mean (the last one tried if none does)."""
    mix = MIXES[settings.rows_mix]
    rate = start
    for _ in range(24):
        rows: dict[str, float] = {}
        _, steps = _simulate(profile, mix.requests(rate, min(settings.seconds, 20.0), settings.seed), rows=rows)
        n = steps.get("decode", (0.0, 0))[1]
        if n and rows.get("decode", 0.0) / n >= settings.target_rows:
            break
        rate *= growth
    return rate


def run_in_situ(profile: Profile, args, settings: InSituSettings, log) -> Profile:
    """The profile with its `serving` section measured on a real 1P+1D cluster (see the module)."""
    started = time.monotonic()
    e = profile.engine
    spec = ClusterSpec(model=args.model, port=0, num_prefill=1, num_decode=1, policy="goodput",
                       slo_ttft_ms=LOOSE_SLO_MS, slo_tpot_ms=LOOSE_SLO_MS, device=args.device, dtype=args.dtype,
                       quantization=args.quantization, max_num_batched_tokens=e["max_num_batched_tokens"],
                       max_num_seqs=e["max_num_seqs"], num_blocks=e["num_blocks"], prefix_caching=False,
                       threads_per_pod=profile.data["device"]["threads"], drain_seconds=2)
    probes = probe_requests(profile, settings.probe_repeats, settings.seed)
    rate = _load_rate(with_serving(profile, ServingProfile()), settings)
    mix = MIXES[settings.mix]
    load = mix.requests(rate, settings.seconds, settings.seed)
    log_dir = tempfile.mkdtemp(prefix="cbserve-profile-")
    log(f"# profile: in situ on a 1P+1D cluster (logs in {log_dir}): {len(probes)} probes, then {settings.mix} "
        f"at {rate:g} req/s for {settings.seconds:g} s")
    with LocalCluster(spec, log_dir=log_dir) as cluster:
        model_id = args.model
        asyncio.run(run_open_loop(cluster.url, model_id, mix.warmup(settings.seed, 4), timeout_s=120))
        probe_results, _ = asyncio.run(run_open_loop(cluster.url, model_id, probes, timeout_s=120, desc="probes"))
        load_results, step_seconds, cpu_used, threads = _load_run(cluster, load, model_id)
        # The decode-batch run's rate at the probes' factors: at the profiled cost alone a machine
        # twice as slow (tiny, session 11) put 100 rows in a step, not 12: past the knee.
        fit = _fit_probes(profile, probes, probe_results)
        at_probes = with_serving(profile, ServingProfile(contention=fit["decode_contention_alone"],
                                                         prefill_contention=fit["prefill_contention_alone"]))
        rows_rate = _rows_rate(at_probes, settings, rate)
        log(f"# profile: then {settings.rows_mix} at {rows_rate:g} req/s (the decode pod at about "
            f"{settings.target_rows:g} rows a step, at the probes' factors)")
        rows_run = _load_run(cluster, MIXES[settings.rows_mix].requests(rows_rate, settings.seconds, settings.seed),
                             model_id)
        prefill_rate = _load_rate(at_probes, settings, target_busy=settings.prefill_busy, mix=settings.prefill_mix,
                                  role="prefill")
        log(f"# profile: then {settings.prefill_mix} at {prefill_rate:g} req/s (the prefill pod about "
            f"{settings.prefill_busy:.0%} busy, at the probes' factors)")
        prefill_run = _load_run(cluster, MIXES[settings.prefill_mix].requests(prefill_rate, settings.seconds,
                                                                               settings.seed), model_id)
    raw = {"probes": [_result_json(r) for r in probe_results], "load": [_result_json(r) for r in load_results],
           "load_rate": rate, "step_seconds": step_seconds, "cpu_seconds": cpu_used, "cpu_threads": threads,
           "decode_high": _run_json(settings.rows_mix, rows_rate, rows_run),
           "prefill_high": _run_json(settings.prefill_mix, prefill_rate, prefill_run)}
    # Colocated pods share the machine differently (no KV streaming, mixed steps): their own runs,
    # at two loads (`_colocated_check`); and one pod alone, whose steps no other engine's slow down.
    raw["colocated"], raw["colocated_high"] = _colocated_runs(
        profile, args, spec, COLOCATED, (settings.target_busy, settings.high_busy), settings, log_dir, log)
    raw["alone"], raw["alone_prefill"] = _colocated_runs(profile, args, spec, ALONE, (settings.target_busy,), settings,
                                                         log_dir, log, prefill_run=True)
    raw["seconds"] = time.monotonic() - started
    profile.data["in_situ_raw"] = raw
    return fit_in_situ(profile, raw, settings)


def _colocated_runs(profile: Profile, args, spec: ClusterSpec, fields: dict, targets: tuple[float, ...],
                    settings: InSituSettings, log_dir: str, log, prefill_run: bool = False) -> list[dict]:
    """A colocated cluster's (`fields`) load runs, one after another on one cluster, each at the
    rate that keeps the simulated pods busy that `targets` share of the time, each one above the
    last (a finer ladder from it: the first's steps of 1.5x can jump from 60% busy to past the
    knee, tiny's did); each as `raw["colocated"]` / `raw["colocated_high"]` / `raw["alone"]` keep it.
    With `prefill_run`, then `settings.prefill_mix` with the pods `prefill_busy` of the time
    (`raw["alone_prefill"]`: a lone pod's prefill part, `_fit_alone`)."""
    mix, pods = MIXES[settings.mix], fields["num_colocated"]
    bare = with_serving(profile, ServingProfile())
    runs_of = [(settings.mix, _load_rate(bare, settings, fields, targets[0]))]
    for busy in targets[1:]:
        runs_of.append((settings.mix, _load_rate(bare, settings, fields, busy, start=runs_of[-1][1] * HIGHER_RATE,
                                                 growth=HIGHER_RATE)))
    if prefill_run:
        runs_of.append((settings.prefill_mix, _load_rate(bare, settings, fields, settings.prefill_busy,
                                                         mix=settings.prefill_mix)))
    log(f"# profile: in situ on a colocated-{pods} cluster: " + ", then ".join(f"{m} at {r:g}" for m, r in runs_of)
        + " req/s")
    runs = []
    with LocalCluster(replace(spec, num_prefill=0, num_decode=0, num_colocated=pods), log_dir=log_dir) as cluster:
        asyncio.run(run_open_loop(cluster.url, args.model, mix.warmup(settings.seed, 4), timeout_s=120))
        for name, rate in runs_of:
            results, steps, cpu_used, threads = _load_run(cluster, MIXES[name].requests(rate, settings.seconds,
                                                                                        settings.seed), args.model)
            runs.append({"mix": name, "load_rate": rate, "load": [_result_json(r) for r in results],
                         "step_seconds": steps, "cpu_seconds": cpu_used, "cpu_threads": threads})
    return runs


def _load_run(cluster: LocalCluster, requests: list[RequestSpec], model_id: str):
    """The client's results and each role's (sum, count) of step seconds over the run."""
    before = {p.name: prom.scrape(p.metrics_url) for p in cluster.pods}
    cpu_before, started = cpu.cluster_cpu_seconds(cluster), time.monotonic()
    threads_before = cpu.cluster_thread_cpu_seconds(cluster)
    results, _ = asyncio.run(run_open_loop(cluster.url, model_id, requests, timeout_s=120, desc="load"))
    cpu_used = cpu.delta(cpu.cluster_cpu_seconds(cluster), cpu_before) | {"wall": time.monotonic() - started}
    threads = cpu.thread_split(cpu.cluster_thread_cpu_seconds(cluster), threads_before)
    after = {p.name: prom.scrape(p.metrics_url) for p in cluster.pods}
    by_role: dict[str, prom.Samples] = {}
    for p in cluster.pods:
        for key, value in prom.delta(after[p.name], before[p.name]).items():
            by_role.setdefault(p.role, {})
            by_role[p.role][key] = by_role[p.role].get(key, 0.0) + value
    return results, _step_means(by_role), cpu_used, threads


def _run_json(mix: str, rate: float, run: tuple) -> dict:
    """A second or third 1P+1D run (`_load_run`'s answer) as `raw` keeps it."""
    results, steps, cpu_used, threads = run
    return {"mix": mix, "load_rate": rate, "load": [_result_json(r) for r in results], "step_seconds": steps,
            "cpu_seconds": cpu_used, "cpu_threads": threads}


def _result_json(r: RequestResult) -> dict:
    return {k: getattr(r, k) for k in ("index", "scheduled_s", "sent_s", "outcome", "first_token_s", "last_token_s",
                                       "done_s", "num_chunks", "num_output_tokens")}


def fit_in_situ(profile: Profile, raw: dict, settings: InSituSettings) -> Profile:
    """The serving section from an in-situ run's measurements (`raw`, as `run_in_situ` stores them):
    probes first, then the load run's contention, loop gap and request path."""
    probes = probe_requests(profile, settings.probe_repeats, settings.seed)
    load = MIXES[settings.mix].requests(raw["load_rate"], settings.seconds, settings.seed)
    probe_results = [RequestResult(**r) for r in raw["probes"]]
    load_results = [RequestResult(**r) for r in raw["load"]]
    measured_steps = {role: tuple(v) for role, v in raw["step_seconds"].items()}
    measured = _medians(load_results)

    probe_fit = _fit_probes(profile, probes, probe_results)
    serving = _serving_from_probes(probe_fit, profile.engine["kv_bytes_per_token"])
    serving = _fit_cpu(profile, raw, settings, serving)
    high, prefill = raw.get("decode_high"), raw.get("prefill_high")
    serving = _fit_decode(profile, load, measured_steps, high, settings, serving, prefill)
    # What the steps do not explain: a loop gap per decode step (TPOT), then a longer request path
    # (TTFT); then the machine's slow stretches (the tails: TTFT's and TPOT's p90 over p50), and
    # the medians once more under them.
    path = (serving.http_in_s, serving.token_out_s)
    serving = _fit_medians(profile, load, measured, serving)
    serving = _fit_jitter(profile, load, load_results, serving)
    serving = _fit_decode(profile, load, measured_steps, high, settings, serving, prefill)  # jitter moves the mean step
    serving = _fit_medians(profile, load, measured, replace(serving, http_in_s=path[0], token_out_s=path[1]))
    simulated, _ = _simulate(with_serving(profile, serving), load)
    colocated = raw.get("colocated")
    check = None
    if colocated:
        requests = _run_requests(colocated, settings)
        serving = _fit_colocated_contention(profile, requests, COLOCATED, "colocated_contention",
                                            colocated["step_seconds"], serving)
        serving = replace(serving, colocated_split=True)
        check = _colocated_check(profile, settings, [r for r in (colocated, raw.get("colocated_high")) if r], serving)
    alone_check = None
    if raw.get("alone"):
        serving, alone_check = _fit_alone(profile, raw["alone"], raw.get("alone_prefill"), settings, serving)
    final = _medians(simulated)
    residual = {f"p50_{k.removesuffix('_s')}_measured_s": v for k, v in measured.items()}
    residual |= {f"p50_{k.removesuffix('_s')}_simulated_s": v for k, v in final.items()}
    in_situ = {"cluster": "1P1D", "calibration_mix": settings.mix, "load_rate": raw["load_rate"],
               "load_seconds": settings.seconds,
               "colocated_load_rate": colocated["load_rate"] if colocated else None,
               "alone_load_rate": (raw.get("alone") or {}).get("load_rate"), "colocated_check": check,
               "alone_prefill": {k: raw["alone_prefill"][k] for k in ("mix", "load_rate")}
               if raw.get("alone_prefill") else None, "alone_check": alone_check,
               "decode_high": {k: high[k] for k in ("mix", "load_rate")} if high else None,
               "decode_check": _decode_check(profile, load, measured_steps, high, settings, serving),
               "prefill_high": {k: prefill[k] for k in ("mix", "load_rate")} if prefill else None,
               "prefill_check": _prefill_check(profile, load, measured_steps, prefill, settings, serving),
               "probe_fit": probe_fit, "step_seconds_measured": {r: (t / c if c else None) for r, (t, c) in
                                                                 measured_steps.items()},
               "load_residual": residual, "seconds": raw.get("seconds")}
    return with_serving(profile, replace(serving, in_situ=in_situ))
