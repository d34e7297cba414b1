"""`cbserve plan`: predicted goodput, capacity per configuration, and a Helm values file.

    cbserve plan --profile p.json --mix chat --rates 1 2 4 8 --configs colocated-2 pd-goodput --json rows.json
    cbserve plan --profile p.json --trace traffic.jsonl --search --values-out values.yaml --plot plan.png
    cbserve plan --model tiny --search            # profiles this device first (see `cbserve profile`)

Without `--search` it predicts `bench/goodput.py`'s rows (same fields, same requests and seeds,
same procedure: one cluster per configuration taking the rates in turn). With `--search` it finds
each configuration's capacity (the highest rate sustained at `--attainment` with the
`--percentile` TTFT and TPOT inside the SLO), recommends one (disaggregated only when it beats
colocated by more than the prediction's uncertainty; `search.py`), and writes the values file
for it with HPA targets at `--headroom` x its capacity band's low end. A table goes to stdout;
`--json` keeps everything; `--plot` draws goodput and attainment against the offered rate for
every probe.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cbserve.goodput.configs import config_name
from cbserve.planner.search import SEARCH_CONFIGS

DEFAULT_CONFIGS = ("pd-goodput", "pd-round-robin", "colocated-2")


def add_plan_command(sub: argparse._SubParsersAction, add_engine_flags) -> None:
    p = sub.add_parser("plan", help="predict goodput and size the pools for an SLO and a workload",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p)
    # With --profile the model and knobs are the profile's unless given here.
    p.set_defaults(model=None, max_num_batched_tokens=None, max_num_seqs=None, kv_cache_groups=None)
    p.add_argument("--profile", default=None, help="a `cbserve profile` file (default: profile this device now)")
    p.add_argument("--profile-out", default=None, help="where to keep the profile made without --profile")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--percentile", type=float, default=90.0, help="TTFT and TPOT percentile held to the SLO")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests meeting both SLOs")
    p.add_argument("--mix", nargs="+", default=None, help="bench/goodput.py mixes (default: chat)")
    p.add_argument("--trace", default=None, metavar="FILE", help="a JSON-lines trace (cbserve/goodput/trace.py)")
    p.add_argument("--rates", nargs="+", type=float, default=[0.5, 1, 2, 4], help="offered req/s (without --search)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", nargs="+", type=config_name, default=None,
                   help=f"configurations (default {' '.join(DEFAULT_CONFIGS)}; with --search {' '.join(SEARCH_CONFIGS)})")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests before a configuration's first rate")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--prefix-caching", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--search", action="store_true", help="find each configuration's capacity and recommend one")
    p.add_argument("--target-rate", type=float, default=None, help="--search: the fewest pods that sustain this rate")
    p.add_argument("--search-duration", type=float, default=20.0,
                   help="--search: seconds of arrivals per probe (its draws are nested, so 20 s suffice)")
    p.add_argument("--search-requests", type=int, default=40,
                   help="--search: at least this many requests per probe (longer probes at low rates)")
    p.add_argument("--tolerance", type=float, default=0.05, help="--search: capacity to within this fraction")
    p.add_argument("--headroom", type=float, default=0.8,
                   help="--search: HPA targets at this share of the capacity band's low end")
    p.add_argument("--max-scale", type=float, default=2.0, help="--search: HPA maxReplicas = this x the planned pool")
    p.add_argument("--values-out", default=None, help="--search: write the Helm values file here")
    p.add_argument("--jobs", type=int, default=2, help="--search: configurations searched at once (processes)")
    p.add_argument("--json", default=None, help="write rows (and the search) here")
    p.add_argument("--plot", default=None, help="write a PNG of goodput and attainment against the offered rate")
    p.set_defaults(func=cmd_plan)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _workloads(args):
    from cbserve.goodput.trace import load_trace
    from cbserve.goodput.workloads import MIXES

    if args.trace and args.mix:
        raise ValueError("give --mix or --trace, not both")
    if args.trace:
        return [load_trace(args.trace)]
    names = args.mix or ["chat"]
    unknown = [n for n in names if n not in MIXES]
    if unknown:
        raise ValueError(f"unknown mix {unknown[0]!r} (mixes: {', '.join(MIXES)})")
    return [MIXES[n] for n in names]


def _profile(args):
    from cbserve.planner.profile import load_profile

    if args.profile:
        profile = load_profile(args.profile)
        if args.model is not None and args.model != profile.model_name:
            raise ValueError(f"--model {args.model} but the profile {args.profile} is of {profile.model_name}")
        return profile
    from cbserve.planner.profile_command import EXIT_REJECTED, cmd_profile

    args.model = args.model or "tiny"
    args.max_num_batched_tokens = args.max_num_batched_tokens or 512
    args.max_num_seqs = args.max_num_seqs or 128
    args.kv_cache_groups = args.kv_cache_groups or "auto"
    out = args.profile_out or f"profiles/{Path(args.model).name}-{args.device}.json"
    profile_args = argparse.Namespace(**vars(args), out=out, threads_per_pod=1, grid="quick", passes=3, repeats=3,
                                      held_out_points=12, max_batch=None, max_context=None, max_held_out_error=0.05,
                                      no_in_situ=False, in_situ_seconds=20.0, calibration_mix="chat")
    _log(f"# plan: no --profile: profiling {args.model} on {args.device} first ({out})")
    status = cmd_profile(profile_args)
    if status == EXIT_REJECTED:
        raise SystemExit(status)
    if status:
        raise SystemExit(status)
    return load_profile(out)


def cmd_plan(args: argparse.Namespace) -> int:
    from cbserve.goodput.report import format_table
    from cbserve.goodput.stats import Slo
    from cbserve.goodput.trace import TraceError
    from cbserve.planner.profile import ProfileError

    try:
        workloads = _workloads(args)
        profile = _profile(args)
    except (ValueError, TraceError, ProfileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    max_len = profile.engine["max_model_len"]
    for w in workloads:
        if w.max_total_tokens > max_len:
            print(f"error: {w.name} needs {w.max_total_tokens} tokens; the profiled engine holds {max_len}",
                  file=sys.stderr)
            return 2
    if profile.serving is None:
        _log("# plan: the profile has no in-situ measurements: serving overhead assumed zero")
    from cbserve.planner.simulate import sim_model

    model = sim_model(profile, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                      request_timeout_s=args.request_timeout, kv_cache_groups=args.kv_cache_groups)
    kv_groups = model.shape.kv.describe()
    _log(f"# plan: KV cache: {kv_groups}")
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    caching = None if args.prefix_caching == "auto" else args.prefix_caching == "on"
    started = time.monotonic()
    meta = {"prediction": True, "profile": args.profile or args.profile_out, "model": profile.model_name,
            "device": profile.data["device"], "held_out_error": profile.held_out_error,
            "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "percentile": args.percentile,
            "attainment": args.attainment, "kv_groups": kv_groups, "mixes": [w.name for w in workloads], "trace": args.trace,
            "duration_s": args.search_duration if args.search else args.duration, "seed": args.seed}
    if args.search:
        from cbserve.planner.plan_search import run_search

        output = run_search(args, profile, model, workloads[0], slo, caching, _log)
        meta["seconds"] = time.monotonic() - started
        rows = output.pop("rows")
    else:
        from cbserve.planner.simulate import sweep

        rows, output = [], {}
        print(format_table([], header=True), flush=True)
        for workload in workloads:
            for config in args.configs or DEFAULT_CONFIGS:
                mine = sweep(model, config, workload, args.rates, args.duration, args.seed, slo, warmup=args.warmup,
                             prefix_caching=caching)
                print(format_table(mine, header=False), flush=True)
                rows += mine
        meta["rates"] = args.rates
        meta["seconds"] = time.monotonic() - started
        _log(f"# plan: {len(rows)} rows in {meta['seconds']:.1f} s")
    if args.plot:
        from cbserve.goodput.plots import plot_mix

        plot_mix(rows, model=profile.model_name, mix=workloads[0].name, slo_ttft_ms=args.slo_ttft_ms,
                 slo_tpot_ms=args.slo_tpot_ms, path=Path(args.plot))
        _log(f"# plan: plot {args.plot}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, **output}, indent=1) + "\n")
        _log(f"# plan: json {args.json}")
    return 0
