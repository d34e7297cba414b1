"""`cbserve profile`: measure the step cost model and the serving path on this device, write a profile.

    cbserve profile --model tiny --out profiles/tiny-cpu.json
    cbserve profile --model small --quantization int8 --max-batch 32 --out profiles/small-int8.json

Stage A times the pods' own engine (the engine flags given here) on a grid of step shapes and fits
the cost model (`profiler.py`); a held-out error above 5% (`--max-held-out-error`) refuses the
profile: exit status 3, nothing written but `<out>.rejected.json` to look at. Stage B runs a real
1P+1D cluster for about a minute to measure what serving adds (`in_situ.py`; `--no-in-situ` skips
it, and plans then assume no serving overhead). On CPU, steps are timed in thread CPU seconds and
every pod runs `--threads-per-pod` torch threads, as `bench/goodput.py`'s pods do.

The stages can run apart: `--no-in-situ` writes stage A alone, and `--grid-from FILE` takes stage A
from such a profile (same model, same engine flags) and runs stage B only, so neither has to fit
one sitting on a shared machine, and the serving path can be measured again without the grid.

    cbserve profile --model small --quantization int8 --no-in-situ --out profiles/small-grid.json
    cbserve profile --model small --quantization int8 --grid-from profiles/small-grid.json --out profiles/small.json

Stage A itself can run in several sittings: `--resume FILE` keeps every measured grid point in FILE
(`grid_journal.py`); stop the command anywhere and run it again, same flags, to go on where it was.

    timeout 230 cbserve profile --model small --quantization int8 --no-in-situ --resume small.journal \
        --out profiles/small-grid.json          # again, until it writes the profile
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cbserve.planner.profile import MAX_HELD_OUT_ERROR

EXIT_REJECTED = 3


def add_profile_command(sub: argparse._SubParsersAction, add_engine_flags) -> None:
    """Register `cbserve profile` (engine flags as every engine command takes them)."""
    p = sub.add_parser("profile", help="measure this device's step costs and serving overhead for `cbserve plan`",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p)
    p.add_argument("--out", required=True, help="the profile file to write (JSON)")
    p.add_argument("--threads-per-pod", type=int, default=1,
                   help="torch threads of the profiled engine and of the in-situ pods (bench/goodput.py's pods: 1)")
    p.add_argument("--grid", choices=["quick", "full"], default="quick",
                   help="quick: three contexts; full: every context from 32 to --max-context")
    p.add_argument("--passes", type=int, default=3, help="rounds over the grid, each in a new random order")
    p.add_argument("--repeats", type=int, default=3, help="steps per grid point and round")
    p.add_argument("--held-out-points", type=int, default=12)
    p.add_argument("--max-batch", type=int, default=None, help="largest decode batch profiled (default min(max-num-seqs, 64))")
    p.add_argument("--max-context", type=int, default=None, help="longest context profiled (default min(max-model-len - 64, 2048))")
    p.add_argument("--max-held-out-error", type=float, default=MAX_HELD_OUT_ERROR,
                   help="refuse a profile whose held-out MAPE is above this (default 0.05)")
    p.add_argument("--no-in-situ", action="store_true", help="skip stage B (the real 1P+1D run)")
    p.add_argument("--grid-from", default=None, metavar="FILE",
                   help="take stage A from this profile (same model and engine flags) and run stage B only")
    p.add_argument("--resume", default=None, metavar="FILE",
                   help="keep each measured grid point in FILE and take those it holds: stage A over several runs")
    p.add_argument("--in-situ-seconds", type=float, default=20.0, help="stage B's load run")
    p.add_argument("--calibration-mix", default="chat", help="stage B's workload (a bench/goodput.py mix)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_profile)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_profile(args: argparse.Namespace) -> int:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads_per_pod)   # the pods' torch threads (the in-situ pods get them too)
    try:
        return _profile(args)
    finally:
        torch.set_num_threads(threads)


def _profile(args: argparse.Namespace) -> int:
    from cbserve.goodput.workloads import MIXES
    from cbserve.planner.in_situ import InSituSettings, run_in_situ
    from cbserve.planner.profile import ProfileError

    if args.calibration_mix not in MIXES:
        print(f"error: --calibration-mix must be one of {', '.join(MIXES)}", file=sys.stderr)
        return 2
    if args.grid_from and args.no_in_situ:
        print("error: --grid-from runs stage B only and --no-in-situ skips it: nothing to do", file=sys.stderr)
        return 2
    if args.grid_from and args.resume:
        print("error: --grid-from takes stage A from a profile and --resume measures it: choose one", file=sys.stderr)
        return 2
    started = time.monotonic()
    if args.grid_from:
        try:
            profile = _stage_a_from(args)
        except ProfileError as e:
            print(f"error: --grid-from {e}", file=sys.stderr)
            return 2
    else:
        try:
            profile = _stage_a(args)
        except ProfileError as e:
            print(f"error: --resume {e}", file=sys.stderr)
            return 2
        if profile is None:
            return EXIT_REJECTED
    if not args.no_in_situ:
        stage_b = time.monotonic()
        profile = run_in_situ(profile, args, InSituSettings(seconds=args.in_situ_seconds, mix=args.calibration_mix,
                                                            seed=args.seed), _log)
        profile.data["seconds"]["in_situ"] = time.monotonic() - stage_b
        s = profile.serving
        _log(f"# profile: serving: contention decode {s.contention:.2f}"
             + (f" + {s.decode_row_s * 1e3:.3f} ms a row" if s.decode_row_s else "")
             + f" prefill {s.prefill_contention:.2f} "
             f"colocated {'split by part, ' if s.colocated_split else ''}one factor {s.contention_of('colocated'):.2f}, "
             f"loop gap {s.step_gap_s * 1e3:.1f} ms, request path {(s.http_in_s + s.rpc_s + s.token_out_s) * 1e3:.1f} ms, "
             f"KV {s.kv_message_s * 1e3:.1f} ms + {_rate(s.kv_bytes_per_s)}; "
             f"{profile.data['seconds']['in_situ']:.0f} s")
    seconds = profile.data["seconds"]
    seconds["total"] = time.monotonic() - started + (seconds["grid"] if args.grid_from else 0.0)
    profile.save(args.out)
    print(args.out)
    return 0


def _stage_a(args: argparse.Namespace):
    """Stage A: the step grid timed and fitted; None when the held-out gate refuses it."""
    import dataclasses

    from cbserve.planner.grid_journal import GridJournal, JournalError
    from cbserve.planner.profile import ProfileError, build_profile
    from cbserve.planner.profiler import (GridSettings, describe, engine_flags, fit_model, grid_json, grid_points,
                                          journal_identity, measure)
    from cbserve.planner.step_grid import TIMERS, timer_name
    from engine.engine import Engine

    config = args.engine_config_from_args(args, "decode")
    # The grid builds its shapes from cached prefixes; caching changes no step's cost.
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_prefix_caching=True))
    started = time.monotonic()
    engine = Engine(config)
    try:
        settings = GridSettings(quick=args.grid == "quick", passes=args.passes, repeats=args.repeats,
                                held_out_points=args.held_out_points, max_batch=args.max_batch,
                                max_context=args.max_context, seed=args.seed)
        timer = timer_name(engine.device.type, args.threads_per_pod)
        journal = None
        if args.resume:
            _, points = grid_points(engine, settings)
            identity = journal_identity(settings, points, model=args.model, fingerprint=engine.fingerprint,
                                        flags=engine_flags(args), threads=args.threads_per_pod, timer=timer)
            try:
                journal = GridJournal(args.resume, identity)
            except JournalError as e:
                raise ProfileError(str(e)) from None
            _log(f"# profile: {len(journal.done)} grid points already measured in {args.resume}")
        fit, held = measure(engine, settings, log=_log, timer=TIMERS[timer], journal=journal)
        identity = describe(engine, args, args.threads_per_pod, timer)
    finally:
        engine.close()
        del engine
    grid_seconds = time.monotonic() - started
    if journal is not None:     # every sitting's measuring, not this one's alone
        grid_seconds = journal.seconds
    model, fit_stats, held_stats = fit_model(fit, held)
    data = identity | grid_json(fit, held) | {"fit": fit_stats, "held_out": held_stats,
                                             "seconds": {"grid": grid_seconds}}
    profile = build_profile(data, model, None)
    _log(f"# profile: step model fit MAPE {fit_stats['mape']:.1%} on {fit_stats['points']} grid points, "
         f"held-out MAPE {held_stats['mape']:.1%} (max {held_stats['max_error']:.1%}) on {held_stats['points']} "
         f"points; {grid_seconds:.0f} s")
    if held_stats["mape"] > args.max_held_out_error:
        rejected = Path(args.out).with_suffix(".rejected.json")
        profile.save(rejected)
        print(f"error: the step model's held-out error is {held_stats['mape']:.1%}, above "
              f"{args.max_held_out_error:.0%}: profile refused (measurements in {rejected}). A busy machine makes "
              f"step times noisy: re-run when it is quieter, or with more --passes", file=sys.stderr)
        return None
    return profile


def _stage_a_from(args: argparse.Namespace):
    """Stage A of `--grid-from`'s profile, which must be of this model with these engine flags and
    have passed this gate (its serving section is measured again)."""
    from cbserve.planner.profile import ProfileError, build_profile, load_profile
    from cbserve.planner.profiler import engine_flags

    profile = load_profile(args.grid_from)
    if profile.model_name != args.model:
        raise ProfileError(f"{args.grid_from}: a profile of {profile.model_name}, not of {args.model}")
    flags, theirs = engine_flags(args), profile.engine.get("flags", {})
    differ = sorted(k for k in flags.keys() | theirs.keys() if flags.get(k) != theirs.get(k))
    if differ:
        raise ProfileError(f"{args.grid_from}: profiled with other engine flags ("
                           + ", ".join(f"{k}: {theirs.get(k)!r} there, {flags.get(k)!r} here" for k in differ) + ")")
    if profile.held_out_error > args.max_held_out_error:
        raise ProfileError(f"{args.grid_from}: held-out error {profile.held_out_error:.1%} is above "
                           f"{args.max_held_out_error:.0%}")
    data = {k: v for k, v in profile.data.items() if k not in ("serving", "in_situ_raw")}
    data["seconds"] = {"grid": profile.data.get("seconds", {}).get("grid", 0.0)}
    data["grid_from"] = str(args.grid_from)
    return build_profile(data, profile.cost_model, None)


def _rate(bytes_per_s: float) -> str:
    return "no bandwidth limit" if bytes_per_s == float("inf") else f"{bytes_per_s / 1e6:.0f} MB/s"
