"""Goodput sweep: open-loop Poisson load against the router, P/D vs round-robin vs colocated.

For each workload mix and each configuration, a fresh local cluster (`LocalCluster`, real processes,
one torch thread per pod so every configuration uses the same two cores) takes a sweep of request
rates; every rate replays the same seeded requests for every configuration. Per rate it reports
offered and completed req/s, p50/p95 TTFT, p95 TPOT, p95 end-to-end, p95 router queue time (router
histogram), error rate, preemptions (pods' counters), SLO attainment and goodput (see bench/stats.py);
the JSON adds each phase's p50/p95 as the router saw it (`phase_s`) and the router's gate calibration
factors at the run's end (`latency_calibration`, as `cbserve plan`'s simulated rows report theirs).

    python -m bench.goodput --quick                                  # smoke test, ~3 min on tiny
    python -m bench.goodput --model tiny --rates 1 2 4 8 --duration 30 --json docs/goodput_tiny.json
    python -m bench.goodput --model small --rates 0.25 0.5 1 2 --duration 60
    python -m bench.goodput --trace traffic.jsonl --configs colocated-2 1P1D --rates 2 4   # a trace

`--trace FILE` replays a trace's request shapes (JSON lines, `cbserve/goodput/trace.py`) instead of
the mixes, at each rate, as `cbserve plan --trace FILE` predicts them. Configurations: the names
below, `colocated-K` or `xPyD` (`cbserve/goodput/configs.py`). Pods cache prefixes only for the
workload whose prompts share them (`--prefix-caching auto`); otherwise a benchmark that repeats
prompts would measure the cache. Plots: docs/goodput_<model>_<mix>.png.

`--repeats N` runs every row N times: pass after pass, each configuration's pass on a fresh
cluster, the configurations interleaved, so that a shared machine's slow minutes (one run at a
knee moves by 10-30% on this 2-core box, the same seed twice) spread over every row's runs; the
JSON keeps every run (`repeat`), the table, plots and ratios take each row's median run, and
`bench/plan_check.py` compares its predictions with those medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):   # `python bench/goodput.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cbserve.goodput import cpu, prom
from cbserve.goodput.loadgen import run_open_loop
from cbserve.goodput.plots import plot_mix
from cbserve.goodput.report import format_table, goodput_ratios, median_runs, print_ratios
from cbserve.goodput.stats import Slo, summarize
from cbserve.goodput.configs import NAMED, config_name, parse_config
from cbserve.goodput.trace import Trace, TraceError, load_trace
from cbserve.goodput.workloads import MIXES, Mix
from cbserve.cluster_spec import ClusterSpec
from cbserve.local_cluster import LocalCluster
from engine.config import QUANTIZATIONS
from router.metrics import PHASES

# The default configurations (name -> ClusterSpec fields). Same two cores for all: each pod gets
# one torch thread.
CONFIGS: dict[str, dict] = NAMED
QUICK = dict(mixes=["chat"], rates=[1.0, 4.0], duration=20.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--mixes", nargs="+", choices=list(MIXES), default=["chat", "long-prompt", "shared-prefix"])
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="replay this trace's requests (JSON lines of prompt_tokens, output_tokens, optional "
                        "prefix_group and prefix_tokens) instead of --mixes"),
    p.add_argument("--rates", nargs="+", type=float, default=[0.5, 1, 2, 4], help="offered req/s")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    p.add_argument("--configs", nargs="+", type=config_name, default=list(CONFIGS),
                   help=f"configurations: {', '.join(CONFIGS)}, colocated-K or xPyD (default: the first three)")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads-per-pod", type=int, default=1)
    p.add_argument("--prefix-caching", choices=["auto", "on", "off"], default="auto",
                   help="auto: only for mixes whose prompts share prefixes")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--device", default=None, help="every pod's --device, e.g. cuda (pods share the one GPU)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="every pod's --num-blocks: a fixed KV cache, so pods sharing one GPU fit beside each other")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help="every pod's --quantization")
    p.add_argument("--cpus", default=None, help="pin the benchmark and every process to these cores, e.g. 0,1")
    p.add_argument("--warmup", type=int, default=4,
                   help="short requests sent (and discarded) before the sweep; at least one per shared prefix")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every configuration's rates this many times, each pass on a fresh cluster and the "
                        "configurations interleaved (every one's first pass, then every one's second, ...); the "
                        "same requests each pass; the table, plots and ratios take each row's median run")
    p.add_argument("--stop-below-attainment", type=float, default=0.05,
                   help="skip a config's higher rates once its attainment falls below this (0: never)")
    p.add_argument("--out-dir", default="docs", help="where the PNGs go")
    p.add_argument("--json", default=None, help="write every summary and the run's settings here")
    p.add_argument("--save-requests", action="store_true", help="also put every request's timings in the JSON")
    p.add_argument("--log-dir", default=None, help="keep each process's log (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="one mix, two rates, 20 s each (smoke test)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, not {args.repeats}")
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def cluster_spec(args: argparse.Namespace, config: str, mix: Mix | Trace) -> ClusterSpec:
    caching = mix.prefix_caching if args.prefix_caching == "auto" else args.prefix_caching == "on"
    return ClusterSpec(model=args.model, port=0, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                       threads_per_pod=args.threads_per_pod, prefix_caching=caching, device=args.device,
                       quantization=args.quantization,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       num_blocks=args.num_blocks, drain_seconds=5, **parse_config(config))


def scrape_all(cluster: LocalCluster) -> tuple[prom.Samples, prom.Samples]:
    """(router samples, all pods' samples merged; pods' label sets differ by pod)."""
    pods: prom.Samples = {}
    for pod in cluster.pods:
        for (name, labels), value in prom.scrape(pod.metrics_url).items():
            pods[(name, labels + (("scraped_pod", pod.name),))] = value
    return prom.scrape(cluster.metrics_url), pods


def _step_seconds(pods: prom.Samples) -> dict[str, float]:
    """Each pod's seconds in engine steps (its `cbserve_step_seconds` sum)."""
    out: dict[str, float] = {}
    for (name, labels), value in pods.items():
        if name == "cbserve_step_seconds_sum":
            pod = dict(labels).get("scraped_pod", "")
            out[pod] = out.get(pod, 0.0) + value
    return out


def run_rate(cluster: LocalCluster, args: argparse.Namespace, mix: Mix | Trace, rate: float, model_id: str) -> dict:
    requests = mix.requests(rate, args.duration, args.seed)
    router_before, pods_before = scrape_all(cluster)
    cpu_before, threads_before = cpu.cluster_cpu_seconds(cluster), cpu.cluster_thread_cpu_seconds(cluster)
    results, elapsed = asyncio.run(run_open_loop(cluster.url, model_id, requests, timeout_s=args.request_timeout,
                                                 api_key=os.environ.get("CBSERVE_API_KEY"),
                                                 desc=f"{mix.name} at {rate:g} req/s"))
    cpu_used = cpu.delta(cpu.cluster_cpu_seconds(cluster), cpu_before)
    threads = cpu.thread_split(cpu.cluster_thread_cpu_seconds(cluster), threads_before)
    router_after, pods_after = scrape_all(cluster)
    router = prom.delta(router_after, router_before)
    queue_p95 = prom.histogram_quantile(0.95, router, "cbserve_request_phase_seconds", phase="router_queue")
    preemptions = int(prom.total(prom.delta(pods_after, pods_before), "cbserve_preemptions_total")) if pods_after else None
    summary = summarize(results, rate=rate, duration_s=args.duration, elapsed_s=elapsed,
                        slo=Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000),
                        p95_router_queue_s=queue_p95 if router_after else None, preemptions=preemptions)
    row = summary.to_dict() | {"sample_errors": sorted({r.error for r in results if r.error})[:3],
                               # each role's mean engine step in the run (what the planner's contention scales)
                               "mean_step_s": prom.mean_by_label(prom.delta(pods_after, pods_before),
                                                                 "cbserve_step_seconds"),
                               "cpu_s": cpu_used,      # each process's CPU seconds in the run (the cores' load)
                               # ... a pod's by thread, beside its engine's own step seconds: what its CPU is
                               "cpu_threads_s": threads, "step_s": _step_seconds(prom.delta(pods_after, pods_before)),
                               "latency_calibration": prom.latency_calibration(router_after),
                               # each phase of a request as the router saw it (router/metrics.py PHASES): where a tail is
                               "phase_s": {phase: {q: prom.histogram_quantile(q / 100, router, "cbserve_request_phase_seconds",
                                                                              phase=phase) for q in (50, 95)}
                                           for phase in PHASES}}
    if args.save_requests:
        row["requests"] = [asdict(r) for r in results]
    return row


def run_config(args: argparse.Namespace, config: str, mix: Mix | Trace, log_root: Path,
               rates: list[float] | None = None, repeat: int = 0) -> list[dict]:
    """One fresh cluster of `config` through `rates` (default `--rates`) in turn; its rows carry `repeat`."""
    rows: list[dict] = []
    spec = cluster_spec(args, config, mix)
    name = f"{mix.name}-{config}" + (f"-repeat{repeat}" if repeat else "")
    with LocalCluster(spec, log_dir=log_root / name) as cluster:
        model_id = args.model
        if args.warmup:
            asyncio.run(run_open_loop(cluster.url, model_id, mix.warmup(args.seed, args.warmup),
                                      timeout_s=args.request_timeout, api_key=os.environ.get("CBSERVE_API_KEY")))
        for rate in args.rates if rates is None else rates:
            cluster.check_alive("during the benchmark")
            row = {"mix": mix.name, "config": config, "repeat": repeat, **run_rate(cluster, args, mix, rate, model_id)}
            rows.append(row)
            print(format_table([row], header=False), flush=True)
            if row["sample_errors"]:
                print(f"#   errors, e.g.: {' | '.join(row['sample_errors'])}", flush=True)
            if row["slo_attainment"] < args.stop_below_attainment:
                print(f"# {config}: attainment {row['slo_attainment']:.0%} at {rate:g} req/s; "
                      f"skipping higher rates", flush=True)
                break
            time.sleep(1.0)   # let cancelled and timed-out requests leave the pods
    return rows


def run_mix(args: argparse.Namespace, mix: Mix | Trace, log_root: Path) -> list[dict]:
    """Every configuration through the rates, `--repeats` passes, the configurations interleaved: a
    shared machine's slow minutes then spread over every row's runs instead of landing on one
    configuration's. A later pass stops where the first did (`--stop-below-attainment`)."""
    rows: list[dict] = []
    reached: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        for config in args.configs:
            if repeat:
                print(f"# {config}: pass {repeat + 1} of {args.repeats}", flush=True)
            mine = run_config(args, config, mix, log_root, rates=reached.get(config), repeat=repeat)
            reached.setdefault(config, [r["rate"] for r in mine])
            rows += mine
    return rows


def model_context_length(model: str) -> int:
    from engine.presets import resolve_model_dir

    config = json.loads((resolve_model_dir(model, create_weights=False) / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    import tempfile

    args = parse_args(argv)
    try:
        workloads = [load_trace(args.trace)] if args.trace else [MIXES[name] for name in args.mixes]
    except TraceError as e:
        raise SystemExit(f"error: {e}") from None
    context = model_context_length(args.model)
    for workload in workloads:
        if workload.max_total_tokens > context:
            raise SystemExit(f"{workload.name} needs {workload.max_total_tokens} tokens; {args.model} has {context}")
    log_root = Path(args.log_dir or tempfile.mkdtemp(prefix="cbserve-goodput-"))
    if args.cpus:   # children inherit the affinity: every configuration runs on the same cores
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    print(f"# model {args.model}, SLO TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms, "
          f"{args.duration:g} s per rate, seed {args.seed}, logs in {log_root}", flush=True)
    rows: list[dict] = []
    for mix in workloads:
        name = mix.name
        print(f"\n## mix {name}: {mix.description}\n{format_table([], header=True)}", flush=True)
        mix_rows = run_mix(args, mix, log_root)
        rows += mix_rows
        if args.repeats > 1:
            mix_rows = median_runs(mix_rows)
            print(f"\n## mix {name}: each row's median of {args.repeats} runs\n{format_table(mix_rows)}", flush=True)
        model_name = Path(args.model).name   # a checkpoint directory: its last component
        path = plot_mix(mix_rows, model=model_name, mix=name, slo_ttft_ms=args.slo_ttft_ms,
                        slo_tpot_ms=args.slo_tpot_ms, path=Path(args.out_dir) / f"goodput_{model_name}_{name}.png")
        print(f"# plot: {path}", flush=True)
    ratios = goodput_ratios(median_runs(rows), baseline="pd-goodput")
    print_ratios(ratios)
    if args.json:
        meta = {"model": args.model, "mixes": [w.name for w in workloads], "trace": args.trace,
                "rates": args.rates, "duration_s": args.duration, "repeats": args.repeats,
                "configs": {c: parse_config(c) for c in args.configs}, "slo_ttft_ms": args.slo_ttft_ms,
                "slo_tpot_ms": args.slo_tpot_ms, "seed": args.seed, "threads_per_pod": args.threads_per_pod,
                "quantization": args.quantization, "device": args.device, "num_blocks": args.num_blocks,
                "cpus": args.cpus, "prefix_caching": args.prefix_caching, "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens, "git_commit": git_commit(),
                "cpu_count": os.cpu_count(), "machine": platform.platform()}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, "ratios": ratios}, indent=1) + "\n")
        print(f"# json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
