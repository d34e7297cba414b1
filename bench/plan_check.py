"""Predicted against measured goodput: replay a `bench/goodput.py` run's JSON through `cbserve plan`.

For every (mix, configuration) of the measured run, the planner predicts the same rows (same
requests, seeds, SLO, rates in turn on one cluster, prefix caching as the run had it) from a
profile, and the table shows measured and predicted goodput, attainment, p95 TTFT and TPOT per row
with the goodput error. Two predictions:
- `profile`: the profile's in-situ contention (what `cbserve plan` predicts);
- `measured contention`: each run's contention set so that the simulated pods' mean step equals
  what the measured pods' step histograms said for that run (`mean_step_s` in the rows; the
  planner's bracketed fixed point, `cbserve.planner.in_situ.fixed_point`). It takes the machine's
  load at measurement time out of the comparison and
  leaves the planner's own modelling error (on a shared machine the load changes from minute to
  minute, and the profile saw another minute).

    python -m bench.plan_check --profile profiles/tiny.json --measured docs/goodput_tiny_heldout.json \\
        --json docs/plan_check_tiny.json

`--over-time SECONDS` compares each run window by window, where the measured run saved its requests
(`bench/goodput.py --save-requests`): arrivals, requests meeting both SLOs and refused, and mean TTFT
and TPOT, measured against predicted, per window of the run. A row's error is then placed in time: a
burst of arrivals the simulated pods ride out and the measured ones do not, or the first seconds of a
fresh cluster.

`--by-request` compares each run request by request against the simulation at its measured
contention (same requests, matched by index): how many met both SLOs, missed one, were refused or
failed, measured against predicted, and the median TTFT and TPOT differences of the requests both
served. Where a row misses at the run's own step lengths, this says whether the pods' latencies
differ or what the two routers admitted (session 16: 1P+1D past its knee, the measured router
refused 3-4x more of what the simulated one served, at the same latencies).

`--refit` fits the profile's serving section again from the in-situ measurements it stores, with
this tree's `planner.in_situ` (a profile made before a change to that fit).

Repeats of the same rows (a `bench/goodput.py --repeats` file, whose passes each ran a fresh
cluster, or several `--measured` files, e.g. one `--seed` each) also give the median table: per
(mix, configuration, rate) the median measured goodput against the median predicted one over the
same runs. At the knee one run of a cluster moves by 10-30% (admission decides on the latest load
reports, and the shared machine's minutes differ); the median of repeats is what a 15% comparison
can be held to. The last lines count what is within 15%: the runs, the medians, and each run
against the mean of its row's other runs, what a prediction knowing each row's average would reach
run by run (the measurement's own spread).

    python -m bench.plan_check --profile profiles/tiny.json --measured run_seed0.json run_seed1.json run_seed2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cbserve.goodput.stats import RequestResult, Slo
from cbserve.goodput.trace import load_trace
from cbserve.goodput.workloads import MIXES
from cbserve.planner.in_situ import fixed_point
from cbserve.planner.profile import load_profile
from cbserve.planner.simulate import sim_model, sweep_runs


def _error(predicted: float, measured: float) -> float | None:
    return None if measured <= 0 else (predicted - measured) / measured


def refit(profile):
    """The profile with its serving section fitted again from its stored in-situ measurements."""
    from cbserve.planner.in_situ import InSituSettings, fit_in_situ

    raw, serving = profile.data.get("in_situ_raw"), profile.serving
    if not raw or serving is None or not serving.in_situ:
        raise SystemExit("the profile has no in-situ measurements to refit")
    info = serving.in_situ
    return fit_in_situ(profile, raw, InSituSettings(seconds=info["load_seconds"], mix=info["calibration_mix"]))


def check(profile_path: str, measured_path: str, refitted: bool = False, window_s: float = 0.0,
          per_request: bool = False) -> list[dict]:
    measured = json.loads(Path(measured_path).read_text())
    meta = measured["meta"]
    profile = load_profile(profile_path)
    if refitted:
        profile = refit(profile)
    if Path(meta["model"]).name != Path(profile.model_name).name:
        raise SystemExit(f"the run measured {meta['model']}, the profile is of {profile.model_name}")
    model = sim_model(profile, max_num_batched_tokens=meta.get("max_num_batched_tokens"),
                      max_num_seqs=meta.get("max_num_seqs"))
    slo = Slo(meta["slo_ttft_ms"] / 1000, meta["slo_tpot_ms"] / 1000)
    caching = {"auto": None, "on": True, "off": False}[meta.get("prefix_caching", "auto")]
    workloads = {w.name: w for w in ([load_trace(meta["trace"])] if meta.get("trace") else [])}
    out = []
    plain_sweeps: dict[tuple, list] = {}    # (mix, config, rates) -> the profile's prediction: the same for every pass
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for row in measured["rows"]:    # one measured cluster each: `bench/goodput.py --repeats` runs a fresh one a pass
        groups.setdefault((row["mix"], row["config"], row.get("repeat", 0)), []).append(row)
    for (mix, config, _), rows in groups.items():
        workload = workloads.get(mix) or MIXES[mix]
        rates = [r["rate"] for r in rows]
        common = dict(warmup=4, prefix_caching=caching, stop_below_attainment=0.0)
        sweep_key = (mix, config, tuple(rates))
        if sweep_key not in plain_sweeps:     # deterministic: the same requests, seed and costs give the same runs
            plain_sweeps[sweep_key] = sweep_runs(model, config, workload, rates, meta["duration_s"], meta["seed"], slo,
                                           **common)
        plain_runs = plain_sweeps[sweep_key]
        plain = [run.row for run in plain_runs]
        # Each (rate, role) factor at which the simulated mean step is the measured one: the
        # planner's own bracketed fixed point (`in_situ.fixed_point`; one ratio overshoots where
        # slower steps grow the batches, and near saturation plain rounds swing).
        measured_steps = {(m["rate"], role): mean for m in rows for role, mean in (m.get("mean_step_s") or {}).items()}
        swept: dict = {"factors": None, "runs": plain_runs}      # the last sweep and the factors it ran at

        def simulate(factors: dict) -> dict:
            swept["factors"], swept["runs"] = dict(factors), sweep_runs(
                model, config, workload, rates, meta["duration_s"], meta["seed"], slo,
                contention=_by_rate(factors), **common)
            return {(run.row["rate"], role): mean for run in swept["runs"]
                    for role, mean in (run.row.get("mean_step_s") or {}).items()}

        factors = {}
        if measured_steps:
            factors = fixed_point(measured_steps, simulate,
                                  {key: _profile_contention(profile, key[1]) for key in measured_steps})
            if factors != swept["factors"]:     # the rounds ran out one step before the factors returned
                simulate(factors)
        oracle_runs, contention = swept["runs"], _by_rate(factors)
        for m, p, run, oracle_run in zip(rows, plain, plain_runs, oracle_runs):
            o = oracle_run.row
            out.append({"mix": mix, "config": config, "rate": m["rate"], "repeat": m.get("repeat", 0),
                        "measured": _figures(m),
                        "predicted": _figures(p), "predicted_measured_contention": _figures(o),
                        "contention": contention.get(m["rate"]),
                        "goodput_error": _error(p["goodput_rps"], m["goodput_rps"]),
                        "goodput_error_measured_contention": _error(o["goodput_rps"], m["goodput_rps"])}
                       | ({"over_time": over_time(m["requests"], run.results, slo, window_s)}
                          if window_s and m.get("requests") else {})
                       | ({"by_request": by_request(m["requests"], oracle_run.results, slo)}
                          if per_request and m.get("requests") else {}))
    return out


def _matched(measured: list[dict], predicted: list[RequestResult]) -> list[tuple[RequestResult, RequestResult]]:
    """(measured, predicted) of each request in both runs, matched by index; `measured` as
    `bench/goodput.py --save-requests` keeps it."""
    simulated = {r.index: r for r in predicted}
    return [(m, simulated[m.index]) for m in (RequestResult(**record) for record in measured) if m.index in simulated]


def over_time(measured: list[dict], predicted: list[RequestResult], slo: Slo, window_s: float) -> list[dict]:
    """One run, window by window of the requests' arrivals: how many arrived, met both SLOs and
    were refused, measured and predicted, and the mean TTFT and TPOT, measured and predicted, of
    the requests served in both. Where a row's goodput misses, this says when: a burst of
    arrivals, the run's first seconds on a fresh cluster, or all along.

    `measured` is `bench/goodput.py --save-requests`'s record of each request; `predicted`, the
    simulated run of the same requests (matched by index)."""
    windows: dict[int, list[tuple[RequestResult, RequestResult]]] = {}
    for m, p in _matched(measured, predicted):
        windows.setdefault(int(m.scheduled_s // window_s), []).append((m, p))

    def means(pairs, name: str) -> list[float | None]:
        both = [(getattr(m, name), getattr(p, name)) for m, p in pairs
                if getattr(m, name) is not None and getattr(p, name) is not None]
        return [statistics.fmean(v) for v in zip(*both)] if both else [None, None]

    return [{"start_s": k * window_s, "requests": len(pairs),
             "met": [sum(slo.met(r[i]) for r in pairs) for i in (0, 1)],
             "refused": [sum(r[i].outcome == "rejected" for r in pairs) for i in (0, 1)],
             "ttft_s": means(pairs, "ttft_s"), "tpot_s": means(pairs, "tpot_s")}
            for k, pairs in sorted(windows.items())]


def _fate(result: RequestResult, slo: Slo) -> str:
    if result.outcome == "rejected":
        return "refused"
    if result.outcome == "cancelled":      # the client gave up on purpose (a mix's cancels)
        return "cancelled"
    if result.outcome != "ok":
        return "failed"
    return "met" if slo.met(result) else "missed"


FATES = ("met", "missed", "refused", "cancelled", "failed")


def by_request(measured: list[dict], predicted: list[RequestResult], slo: Slo) -> dict:
    """One run, request by request: `fates[m][p]`, how many requests had fate m measured and p
    predicted (met both SLOs, missed one, refused with 429/503, cancelled by the client, failed
    otherwise), and the median TTFT and TPOT differences (measured - predicted, seconds) of the
    requests served in both.

    `measured` is `bench/goodput.py --save-requests`'s record of each request; `predicted`, the
    simulated run of the same requests (matched by index)."""
    fates = {m: dict.fromkeys(FATES, 0) for m in FATES}
    ttft, tpot = [], []
    for m, p in _matched(measured, predicted):
        fates[_fate(m, slo)][_fate(p, slo)] += 1
        if m.outcome == p.outcome == "ok":
            if m.ttft_s is not None and p.ttft_s is not None:
                ttft.append(m.ttft_s - p.ttft_s)
            if m.tpot_s is not None and p.tpot_s is not None:
                tpot.append(m.tpot_s - p.tpot_s)
    return {"fates": fates, "served_in_both": len(ttft),
            "ttft_diff_s": statistics.median(ttft) if ttft else None,
            "tpot_diff_s": statistics.median(tpot) if tpot else None}


def _by_rate(factors: dict[tuple[float, str], float]) -> dict[float, dict[str, float]]:
    """(rate, role) -> factor, as `sweep`'s `contention` (rate -> role -> factor)."""
    contention: dict[float, dict[str, float]] = {}
    for (rate, role), factor in factors.items():
        contention.setdefault(rate, {})[role] = factor
    return contention


def _profile_contention(profile, role: str) -> float:
    return 1.0 if profile.serving is None else profile.serving.contention_of(role)


def _figures(row: dict) -> dict:
    return {k: row.get(k) for k in ("goodput_rps", "slo_attainment", "p95_ttft_s", "p95_tpot_s", "error_rate",
                                    "mean_step_s", "latency_calibration")}


WITHIN = 0.15       # the target: predicted goodput within 15% of measured, row by row


def _others_error(runs: list[float], i: int) -> float | None:
    """Run `i` against the mean of the same row's other runs, as a prediction."""
    others = runs[:i] + runs[i + 1:]
    return _error(statistics.fmean(others), runs[i]) if others else None


def medians(rows: list[dict]) -> list[dict]:
    """Per (mix, config, rate) over the runs that measured it: the median measured and predicted
    goodput (each run's prediction replays that run's requests) and the error of the medians;
    and the runs' own spread: each run against the mean of the row's other runs
    (`others_errors`), the best a prediction of each row's average does run by run."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["mix"], r["config"], r["rate"]), []).append(r)
    out = []
    for (mix, config, rate), runs in groups.items():
        goodputs = [r["measured"]["goodput_rps"] for r in runs]
        measured = statistics.median(goodputs)
        predicted = statistics.median(r["predicted"]["goodput_rps"] for r in runs)
        oracle = statistics.median(r["predicted_measured_contention"]["goodput_rps"] for r in runs)
        out.append({"mix": mix, "config": config, "rate": rate, "runs": len(runs),
                    "measured": [r["measured"]["goodput_rps"] for r in runs],
                    "predicted": [r["predicted"]["goodput_rps"] for r in runs],
                    "measured_median": measured, "predicted_median": predicted,
                    "predicted_measured_contention_median": oracle,
                    "goodput_error": _error(predicted, measured),
                    "goodput_error_measured_contention": _error(oracle, measured),
                    "others_errors": [_others_error(goodputs, i) for i in range(len(goodputs))]})
    return out


def within(errors) -> tuple[int, int]:
    """(how many of `errors` are within `WITHIN`, how many there are), None ones left out."""
    known = [e for e in errors if e is not None]
    return sum(abs(e) <= WITHIN for e in known), len(known)


def summary(rows: list[dict], median_rows: list[dict]) -> dict:
    """The counts against the 15% target: runs, medians, and the runs against their row's other runs."""
    out = {"runs": within(r["goodput_error"] for r in rows),
           "runs_measured_contention": within(r["goodput_error_measured_contention"] for r in rows)}
    if median_rows:
        out["medians"] = within(m["goodput_error"] for m in median_rows)
        out["medians_measured_contention"] = within(m["goodput_error_measured_contention"] for m in median_rows)
        out["runs_against_their_other_runs"] = within(e for m in median_rows for e in m["others_errors"])
    return out


def print_summary(counts: dict) -> None:
    label = {"runs": "runs, predicted from the profile",
             "runs_measured_contention": "runs, predicted at their measured contention",
             "medians": "rows' medians, from the profile",
             "medians_measured_contention": "rows' medians, at the measured contention",
             "runs_against_their_other_runs": "runs, 'predicted' by the mean of their row's other runs (the "
                                              "measurement's own spread)"}
    print(f"\nwithin {WITHIN:.0%}:")
    for key, (ok, n) in counts.items():
        print(f"  {ok:3} of {n:3} {label[key]}")


def print_medians(rows: list[dict]) -> None:
    print(f"\n{'mix':14} {'config':12} {'rate':>5} {'runs':>4} | {'measured':>20} {'median':>6} | "
          f"{'predicted':>20} {'median':>6} {'err':>6} | {'pred@meas.c':>11} {'err':>6}")
    err = lambda e: "-" if e is None else f"{e:+.0%}"  # noqa: E731
    runs = lambda vs: " ".join(f"{v:.2f}" for v in vs)  # noqa: E731
    for r in rows:
        print(f"{r['mix']:14} {r['config']:12} {r['rate']:5g} {r['runs']:4} | {runs(r['measured']):>20} "
              f"{r['measured_median']:6.2f} | {runs(r['predicted']):>20} {r['predicted_median']:6.2f} "
              f"{err(r['goodput_error']):>6} | {r['predicted_measured_contention_median']:11.2f} "
              f"{err(r['goodput_error_measured_contention']):>6}")


def _fmt(v, scale=1.0, digits=2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def print_table(rows: list[dict]) -> None:
    print(f"{'mix':14} {'config':12} {'rate':>5} | {'goodput meas':>12} {'pred':>6} {'err':>6} | "
          f"{'pred@meas.c':>11} {'err':>6} | {'attain m/p':>11} | {'ttft95 m/p ms':>14} | {'tpot95 m/p ms':>14}")
    for r in rows:
        m, p, o = r["measured"], r["predicted"], r["predicted_measured_contention"]
        err = lambda e: "-" if e is None else f"{e:+.0%}"  # noqa: E731
        print(f"{r['mix']:14} {r['config']:12} {r['rate']:5g} | {_fmt(m['goodput_rps']):>12} "
              f"{_fmt(p['goodput_rps']):>6} {err(r['goodput_error']):>6} | {_fmt(o['goodput_rps']):>11} "
              f"{err(r['goodput_error_measured_contention']):>6} | "
              f"{_fmt(m['slo_attainment'], 100, 0):>5}/{_fmt(p['slo_attainment'], 100, 0):<5} | "
              f"{_fmt(m['p95_ttft_s'], 1e3, 0):>6}/{_fmt(p['p95_ttft_s'], 1e3, 0):<7} | "
              f"{_fmt(m['p95_tpot_s'], 1e3, 0):>6}/{_fmt(p['p95_tpot_s'], 1e3, 0):<7}")


def print_over_time(rows: list[dict]) -> None:
    ms = lambda v: _fmt(v, 1e3, 0)  # noqa: E731
    for r in rows:
        if not r.get("over_time"):
            continue
        print(f"\n{r['mix']} {r['config']} at {r['rate']:g} req/s ({r.get('measured_file', '')}): measured/predicted")
        print(f"{'from s':>6} {'requests':>8} | {'met':>7} | {'refused':>7} | {'mean ttft ms':>12} | "
              f"{'mean tpot ms':>12}")
        for w in r["over_time"]:
            print(f"{w['start_s']:6g} {w['requests']:8} | {w['met'][0]:>3}/{w['met'][1]:<3} | "
                  f"{w['refused'][0]:>3}/{w['refused'][1]:<3} | {ms(w['ttft_s'][0]):>5}/{ms(w['ttft_s'][1]):<6} | "
                  f"{ms(w['tpot_s'][0]):>5}/{ms(w['tpot_s'][1]):<6}")


def print_by_request(rows: list[dict]) -> None:
    for r in rows:
        if not (b := r.get("by_request")):
            continue
        print(f"\n{r['mix']} {r['config']} at {r['rate']:g} req/s ({r.get('measured_file', '')}): requests, "
              f"measured (rows) against predicted at the measured contention (columns)")
        print(f"{'':>9} " + " ".join(f"{p:>9}" for p in FATES))
        for m in FATES:
            print(f"{m:>9} " + " ".join(f"{b['fates'][m][p]:>9}" for p in FATES))
        print(f"served in both: {b['served_in_both']}, median difference TTFT {_fmt(b['ttft_diff_s'], 1e3, 0)} ms, "
              f"TPOT {_fmt(b['tpot_diff_s'], 1e3, 1)} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True)
    p.add_argument("--measured", required=True, nargs="+", help="bench/goodput.py --json files")
    p.add_argument("--json", default=None)
    p.add_argument("--refit", action="store_true", help="refit the profile's in-situ section with this tree's code")
    p.add_argument("--over-time", type=float, default=0.0, metavar="SECONDS",
                   help="also compare each run window by window of this many seconds (needs the measured "
                        "run's requests: bench/goodput.py --save-requests)")
    p.add_argument("--by-request", action="store_true",
                   help="also compare each run request by request against the simulation at its measured "
                        "contention (needs bench/goodput.py --save-requests)")
    args = p.parse_args(argv)
    rows = []
    for path in args.measured:
        mine = check(args.profile, path, refitted=args.refit, window_s=args.over_time, per_request=args.by_request)
        for r in mine:
            r["measured_file"] = path
        rows += mine
    print_table(rows)
    print_over_time(rows)
    print_by_request(rows)
    median_rows = medians(rows)
    if any(m["runs"] > 1 for m in median_rows):
        print_medians(median_rows)
    else:
        median_rows = []
    counts = summary(rows, median_rows)
    print_summary(counts)
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": args.profile, "refit": args.refit, "rows": rows,
                                               "medians": median_rows, "within": counts}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
