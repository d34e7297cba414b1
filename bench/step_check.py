"""Every measured engine step against a profile's step costs: which part of a step the planner misses.

An engine started with `CBSERVE_STEP_TRACE=DIR` (every pod of a `bench/goodput.py` or `cbserve up`
run inherits it) writes each step to `DIR/steps-<role>-<pid>-<n>.jsonl` (`engine.telemetry.step_stats`):
its wall seconds, the engine thread's CPU seconds and its `StepShape`. This holds each step against
the profile's cost of that shape for the pod's role (`Profile.pod_costs`: the cost model with the
role's in-situ factors and row cost, without the cores' share), by kind of step and decode rows,
and window by window. A colocated pod's engine runs the decode role (`cbserve decode --colocated`),
so its trace is named `decode`: `--colocated` costs such traces as colocated pods, `--alone` as a
one-pod cluster's.
- CPU / profiled near 1: the cost model and the role's factors carry the step's own work; the rest
  of the wall time is waiting for a core (`cpu_share`) or for the GIL;
- wall / CPU: that wait, to hold against the share `cbserve plan` gives (`cpu_share.fair_share`).
A step's CPU is the engine thread's CPU since the previous step ended (its loop's work between steps
included). The run is each trace's longest stretch without a pause of over `--gap` seconds (a
cluster's warm-up and its idle wait for the load are cut off).

    CBSERVE_STEP_TRACE=/tmp/steps python -m bench.goodput --model tiny --configs colocated-2 ...
    python -m bench.step_check --profile docs/planner/tiny_profile_s14a.json --steps /tmp/steps

`--shares GOODPUT_JSON` needs no trace: for every row of a `bench/goodput.py` run on a machine whose
cores the cluster shares, each pod's step wall over its engine thread's CPU (the run's `step_s` and
`cpu_threads_s`) against the share `cbserve plan` gives it from the run's own loads
(`cpu_share.fair_share`: the serving path, every process's CPU less the engine threads', and the
other pods' busy fractions) and against c/n for n wanting.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from cbserve.planner.cpu_share import fair_share
from cbserve.planner.in_situ import serving_cpu_seconds
from cbserve.planner.profile import load_profile
from engine.telemetry.step_shape import StepShape

ROW_BUCKETS = ((0, "0"), (4, "1-4"), (12, "5-12"), (1 << 30, "13+"))


def run_stretch(lines: list[list], gap_s: float) -> list[list]:
    """The longest run of steps with no pause over `gap_s` between one's end and the next's."""
    best, start = (0, 0), 0
    for i in range(1, len(lines) + 1):
        if i == len(lines) or lines[i][0] - lines[i][1] - lines[i - 1][0] > gap_s:
            if i - start > best[1] - best[0]:
                best = (start, i)
            start = i
    return lines[best[0]:best[1]]


def kind_of(shape: StepShape) -> tuple[str, str]:
    kind = "decode" if not shape.prefill_chunks else ("prefill" if not shape.num_decodes else "mixed")
    rows = next(label for top, label in ROW_BUCKETS if shape.num_decodes <= top)
    return kind, rows


def compare(lines: list[list], costs, window_s: float) -> dict:
    """Sums per (kind, rows) and per window: steps, wall, CPU, profiled seconds."""
    kinds: dict = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    windows: dict = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    t0 = lines[0][0] - lines[0][1]
    for (end, wall, cpu, shape_json), previous in zip(lines[1:], lines):
        shape = StepShape.from_json(shape_json)
        row = (1, wall, cpu - previous[2], costs.seconds(shape))
        for table, key in ((kinds, kind_of(shape)), (windows, int((end - t0) // window_s))):
            table[key] = [a + b for a, b in zip(table[key], row)]
    return {"kinds": dict(kinds), "windows": dict(windows)}


def shares(row: dict, cores: float) -> dict[str, dict[str, float]]:
    """Each pod's measured step wall/CPU and the max-min and c/n factors from the row's loads."""
    elapsed, threads = row["elapsed_s"], row["cpu_threads_s"]
    pods = list(row["step_s"])
    serving = serving_cpu_seconds(row["cpu_s"], {}, threads) / elapsed
    busy = {p: row["step_s"][p] / elapsed for p in pods}
    out = {}
    for pod in pods:
        others = [busy[q] for q in pods if q != pod]
        out[pod] = {"busy": busy[pod], "serving_cores": serving,
                    "measured": row["step_s"][pod] / threads[pod]["engine"],
                    "max_min": 1.0 / fair_share([serving, *others], cores),
                    "c_over_n": max(1.0, (1.0 + serving + sum(others)) / cores)}
    return out


def print_shares(paths: list[str]) -> None:
    """Each row's pods (rows without threads or steps skipped); with several files, the median of
    measured over max-min and over c/n per (config, kind of pod)."""
    by_kind: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for path in paths:
        run = json.loads(Path(path).read_text())
        pinned = run["meta"].get("cpus")       # "0,1": the run's processes pinned to those cores
        cores = len(str(pinned).split(",")) if pinned else run["meta"]["cpu_count"]
        for row in run["rows"]:
            if not row.get("cpu_threads_s") or not row.get("step_s"):
                continue
            print(f"== {Path(path).name}: {row['config']} at {row['rate']:g} req/s")
            for pod, s in shares(row, cores).items():
                print(f"  {pod:14s} busy {s['busy']:.2f}  step wall/CPU {s['measured']:.2f}  max-min {s['max_min']:.2f}"
                      f"  c/n {s['c_over_n']:.2f}  (serving {s['serving_cores']:.2f} cores)")
                if s["measured"] > 0.5:       # a pod that never stepped reads 0
                    by_kind[(row["config"], pod.rsplit("-", 1)[0])].append((s["measured"] / s["max_min"],
                                                                            s["measured"] / s["c_over_n"]))
    if len(paths) > 1 and by_kind:
        print("measured / max-min and measured / (c/n), medians:")
        every = [pair for pairs in by_kind.values() for pair in pairs]
        for (config, kind), pairs in sorted(by_kind.items()) + [(("all", ""), every)]:
            print(f"  {config:14s} {kind:10s} {len(pairs):4d} pods  {statistics.median(p[0] for p in pairs):.2f}"
                  f"  {statistics.median(p[1] for p in pairs):.2f}")


def _ratios(n: int, wall: float, cpu: float, profiled: float) -> str:
    return (f"{n:5d} {wall / n * 1e3:8.1f} {cpu / n * 1e3:7.1f} {profiled / n * 1e3:8.1f}   "
            f"{cpu / profiled:5.2f}  {wall / profiled:5.2f}  {wall / cpu:5.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile")
    ap.add_argument("--steps", help="the CBSERVE_STEP_TRACE directory")
    ap.add_argument("--shares", metavar="GOODPUT_JSON", nargs="+",
                    help="each pod's step wall/CPU against the cores' share (several files: a summary by pod kind)")
    ap.add_argument("--colocated", action="store_true", help="the decode traces are colocated pods")
    ap.add_argument("--alone", action="store_true", help="a one-pod cluster (colocated-1): the lone pod's costs")
    ap.add_argument("--window", type=float, default=5.0, help="seconds per window")
    ap.add_argument("--gap", type=float, default=1.0, help="a pause that ends the run's stretch, seconds")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.shares:
        print_shares(args.shares)
        return
    if not (args.profile and args.steps):
        ap.error("--profile and --steps, or --shares")
    profile = load_profile(args.profile)
    costs = profile.pod_costs()
    out = {}
    for path in sorted(Path(args.steps).glob("steps-*.jsonl")):
        role = path.name.split("-")[1]
        lines = run_stretch([json.loads(line) for line in path.read_text().splitlines() if line], args.gap)
        if len(lines) < 2:
            continue
        if (args.alone or args.colocated) and role == "decode":
            role = "colocated"          # a colocated pod's engine runs the decode role
        result = compare(lines, costs["alone" if args.alone and role == "colocated" else role], args.window)
        out[path.name] = result
        print(f"== {path.name}: {len(lines)} steps over {lines[-1][0] - lines[0][0]:.1f} s")
        print("  kind     rows  steps  wall ms  CPU ms  profiled   CPU/p  wall/p  wall/CPU")
        for (kind, rows), sums in sorted(result["kinds"].items()):
            print(f"  {kind:8s} {rows:5s}" + _ratios(*sums))
        print("  all           " + _ratios(*[sum(s[i] for s in result["kinds"].values()) for i in range(4)]))
        print("  windows (CPU/p, wall/CPU):", " ".join(
            f"{k * args.window:.0f}s {s[2] / s[3]:.2f} {s[1] / s[2]:.2f}" for k, s in sorted(result["windows"].items())))
    if args.json:
        Path(args.json).write_text(json.dumps({name: {part: {str(k): v for k, v in table.items()}
                                                      for part, table in r.items()} for name, r in out.items()}, indent=1))


if __name__ == "__main__":
    main()
