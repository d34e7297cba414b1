"""`cbserve plan --search`'s run: capacities, uncertainty bands, the recommendation, the values file.

Each configuration's capacity is searched (`search.find_capacity`) on fresh simulated clusters, in
`--jobs` processes, from a guess per pod that only the profile and the workload decide
(`per_pod_guess`); every rate replays one draw of the workload, compressed (`simulate.NestedWorkload`); the best colocated
and the best disaggregated one are searched again with steps `1 ± u` times as long for their bands
(u: the profile's held-out error plus the larger of the in-situ calibration's residual and stage
B's out-of-sample step error, `uncertainty`); `search.recommend` decides; the recommended
configuration runs once more at `--headroom` x its band's low end (its capacity with the steps
`1 + u` times as long), and its pods' mean load there sets the values file's HPA targets.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

from cbserve.goodput.configs import is_disaggregated, num_pods, parse_config
from cbserve.planner.helm_values import render, values
from cbserve.planner.search import SEARCH_CONFIGS, Capacity, Criterion, Probe, find_capacity, recommend
from cbserve.planner.simulate import NestedWorkload, at_rate, sim_model
from engine.telemetry.step_shape import StepShape

MAX_UNCERTAINTY = 0.5     # steps 1.5x as long: beyond it a band says nothing a plan can use
_TABLE = ("config", "pods", "capacity", "per-pod", "band per pod", "ttft p95", "tpot p95", "attain", "probes")


def uncertainty(profile) -> float:
    """The relative error of a step's predicted time: the held-out step error, plus the larger of
    the calibration residual and stage B's out-of-sample step error.

    The out-of-sample error is the worst of the colocated-2 cluster's two runs (`colocated_check`):
    a colocated step is split by part at the 1P+1D factors, so neither run was fitted on, and they
    are the one place where stage B predicts a mean step it has not seen. The calibration residual
    alone (the medians, which the fit matches by construction) left the band at the held-out error,
    5-7%, where the capacities measured 20-45% below the search's on two machines (sessions 13-14)
    and the colocated checks missed by 5-27%."""
    info = profile.serving.in_situ if profile.serving is not None else {}
    residual = info.get("load_residual", {})
    pairs = [(residual.get(f"p50_{name}_measured_s"), residual.get(f"p50_{name}_simulated_s"))
             for name in ("ttft", "tpot")]
    pairs += [(c.get("measured_step_s"), c.get("simulated_step_s")) for c in info.get("colocated_check") or ()]
    worst = max((abs(s - m) / m for m, s in pairs if m and s), default=0.0)
    return min(profile.held_out_error + worst, MAX_UNCERTAINTY)


def oversubscribed(profile, capacities: list[Capacity]) -> list[str]:
    """The configurations whose pods outnumber the cores they share (a CPU profile's `cores`; 0:
    a device each). The max-min share (`cpu_share`) gets their waits for a core (colocated-3 on 2
    cores: step wall/CPU 1.9-2.2, max-min 2.0), but not their steps' CPU, 1.3x the colocated costs
    (three engines lose their caches at each switch): tiny's colocated-3 and 2P1D measured 16-110%
    below prediction (sessions 14-15)."""
    cores = profile.serving.cores if profile.serving is not None else 0.0
    return [c.config for c in capacities if cores > 0 and c.pods > cores]


def probe_seconds(args, rate: float) -> float:
    """A probe's arrivals: `--search-duration`, longer at low rates so that it has at least
    `--search-requests` requests (attainment over a handful of requests is a coin toss)."""
    return max(args.search_duration, args.search_requests / rate)


def _evaluator(args, model, config, workload, slo, caching, criterion):
    def evaluate(rate: float) -> Probe:
        run = at_rate(model, config, workload, rate, probe_seconds(args, rate), args.seed, slo, warmup=args.warmup,
                      prefix_caching=caching)
        return Probe(rate, run.row, criterion.sustained(run.row, run.results), run.load)
    return evaluate


def _table(capacities: list[Capacity]) -> str:
    lines = ["  ".join(f"{h:>12}" if i else f"{h:<16}" for i, h in enumerate(_TABLE))]
    for c in capacities:
        probe = c.at_capacity
        low, high = c.band
        cells = [c.config, str(c.pods), f"{c.capacity_rps:.2f}", f"{c.per_pod:.2f}",
                 f"{low / c.pods:.2f}-{high / c.pods:.2f}" if c.low_rps is not None else "-",
                 _ms(probe.row["p95_ttft_s"]) if probe else "-", _ms(probe.row["p95_tpot_s"]) if probe else "-",
                 f"{probe.row['slo_attainment']:.0%}" if probe else "-", str(len(c.probes))]
        lines.append("  ".join(f"{v:>12}" if i else f"{v:<16}" for i, v in enumerate(cells)))
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


# What the forked search workers read (set before the pool forks, so nothing is pickled but names).
_JOB: dict = {}


def _search_config(config: str) -> Capacity:
    job = _JOB
    fields = parse_config(config)
    pods = num_pods(fields)
    capacity, probes = find_capacity(
        _evaluator(job["args"], job["model"], config, job["workload"], job["slo"], job["caching"], job["criterion"]),
        start=job["per_pod_guess"] * pods, tolerance=job["args"].tolerance)
    return Capacity(config, pods, is_disaggregated(fields), capacity, probes)


def _search_band(task: tuple[str, float, float]) -> float:
    config, capacity, scale = task
    job, args = _JOB, _JOB["args"]
    scaled = sim_model(job["profile"], job["model"].tokenizer, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_seqs=args.max_num_seqs, step_scale=scale, request_timeout_s=args.request_timeout)
    # Slower steps, less capacity, about in proportion: start there.
    band, _ = find_capacity(_evaluator(args, scaled, config, job["workload"], job["slo"], job["caching"],
                                       job["criterion"]), start=capacity / scale, tolerance=args.tolerance)
    return band


def _map(function, items: list, jobs: int) -> list:
    """`function` over `items`, in `jobs` forked processes (in order)."""
    if jobs <= 1 or len(items) <= 1:
        return [function(item) for item in items]
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(min(jobs, len(items))) as pool:
        return pool.map(function, items, chunksize=1)


def per_pod_guess(model, workload, seed: int) -> float:
    """Where a search starts, per pod: a request's work alone (its prefill, then its decodes at
    batch 1) shared four ways by batching. Only the profile and the workload decide it, so a
    configuration's capacity never depends on which others are searched with it."""
    costs = model.pod_costs["decode"] if isinstance(model.pod_costs, dict) else model.pod_costs
    sample = workload.requests(1.0, 50.0, seed)
    work = 0.0
    for request, ids in zip(sample, model.encode(sample)):
        n = len(ids)
        work += costs.seconds(StepShape(0, 0, prefill_chunks=((n, 0),), num_sampled=1))
        work += request.max_tokens * costs.seconds(StepShape(1, n, n, n, num_sampled=1))
    work = work / len(sample)
    return 4.0 / work if work > 0 else 1.0


def _search_bands(capacities: list[Capacity], u: float, args, log) -> None:
    """Each one's uncertainty band: its capacity searched again with every step `1 ± u` times as long."""
    tasks = [(c.config, c.capacity_rps, scale) for c in capacities for scale in (1 + u, 1 - u)]
    bands = _map(_search_band, tasks, args.jobs)
    for i, c in enumerate(capacities):
        c.low_rps, c.high_rps = min(bands[2 * i], c.capacity_rps), max(bands[2 * i + 1], c.capacity_rps)
        log(f"# plan: {c.config}: band {c.low_rps:.2f}-{c.high_rps:.2f} req/s (steps x{1 + u:.3f} / x{1 - u:.3f})")


def run_search(args, profile, model, workload, slo, caching, log) -> dict:
    criterion = Criterion(slo, args.attainment, args.percentile)
    configs = args.configs or list(SEARCH_CONFIGS)
    workload = NestedWorkload(workload)
    _JOB.update(args=args, profile=profile, model=model, workload=workload, slo=slo, caching=caching,
                criterion=criterion, per_pod_guess=per_pod_guess(model, workload, args.seed))
    capacities = _map(_search_config, configs, args.jobs)
    for c in capacities:
        log(f"# plan: {c.config}: {c.capacity_rps:.2f} req/s ({len(c.probes)} probes)")
    crowded = oversubscribed(profile, capacities)
    if crowded:
        log(f"# plan: note: {', '.join(crowded)} put more engine pods than the profile's "
            f"{profile.serving.cores:g} cores on one machine; such clusters measured 16-110% below their prediction "
            f"(docs/capacity_planning.md, sessions 14-15): do not size a deployment on them")
    u = uncertainty(profile)
    finalists = [c for c in (max((c for c in capacities if not c.disaggregated), key=lambda c: c.per_pod, default=None),
                             max((c for c in capacities if c.disaggregated), key=lambda c: c.per_pod, default=None))
                 if c is not None and c.capacity_rps > 0]
    _search_bands(finalists, u, args, log)
    decision = recommend(capacities, args.target_rate)
    chosen = next(c for c in capacities if c.config == decision.config)
    if chosen.low_rps is None and chosen.capacity_rps > 0:     # `--target-rate` chose one that is no finalist
        _search_bands([chosen], u, args, log)
    print(_table(capacities))
    print(f"recommendation: {decision.config}: {decision.reason}")
    output: dict = {"search": {"uncertainty": u, "oversubscribed": crowded,
                               "criterion": {"attainment": args.attainment, "percentile": args.percentile},
                               "capacities": [_capacity_json(c) for c in capacities],
                               "recommendation": asdict(decision)}}
    if chosen.capacity_rps > 0:
        # The HPA targets at the slow end of the band: a cluster sized at the point estimate missed
        # its SLO wherever the steps ran as slow as stage B's own checks (sessions 13-14).
        low, high = chosen.band
        rate = low * args.headroom
        run = at_rate(model, chosen.config, workload, rate, probe_seconds(args, rate), args.seed, slo, warmup=args.warmup,
                      prefix_caching=caching)
        fields = parse_config(chosen.config)
        helm = values(fields=fields, profile=profile, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                      load=run.load, max_scale=args.max_scale, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_num_seqs=args.max_num_seqs)
        output["search"]["operating_point"] = {"rate": rate, "row": run.row, "load": run.load}
        if args.values_out:
            header = [f"cbserve plan: {chosen.config} for {workload.name}, SLO TTFT <= {args.slo_ttft_ms:g} ms and "
                      f"TPOT <= {args.slo_tpot_ms:g} ms at {args.attainment:.0%} attainment",
                      f"predicted capacity {chosen.capacity_rps:.2f} req/s (band {low:.2f}-{high:.2f}, steps "
                      f"x{1 + u:.2f} to x{1 - u:.2f}); HPA targets at {rate:.2f} req/s ({args.headroom:.0%} of "
                      f"the band's low end); profile {args.profile or args.profile_out} "
                      f"(held-out step error {profile.held_out_error:.1%})",
                      f"why: {decision.reason}", "helm upgrade --install cbserve ./helm -f <this file>"]
            Path(args.values_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.values_out).write_text(render(helm, header))
            log(f"# plan: values {args.values_out}")
        output["search"]["values"] = helm
    rows = [p.row for c in capacities for p in sorted(c.probes, key=lambda p: p.rate)]
    output["rows"] = rows
    return output


def _capacity_json(c: Capacity) -> dict:
    low, high = c.band
    return {"config": c.config, "pods": c.pods, "disaggregated": c.disaggregated, "capacity_rps": c.capacity_rps,
            "per_pod_rps": c.per_pod, "band_rps": [low, high] if c.low_rps is not None else None,
            "probes": [{"rate": p.rate, "sustained": p.sustained, "goodput_rps": p.row["goodput_rps"],
                        "slo_attainment": p.row["slo_attainment"]} for p in c.probes],
            "finite": math.isfinite(c.capacity_rps)}
