"""`cbserve profile`, stage A: the step cost model of one engine on this device, and its held-out error.

The engine is the pods' own (`cbserve.cli.engine_config_from_args`, decode role, the same flags),
with the pods' torch thread count. Grid and held-out points (`step_grid.py`) are measured in
`passes` rounds, each in a fresh random order, `repeats` steps per point and round, so that a
point's samples are spread over the whole run and a stretch of interference (a neighbour's burst)
lands on every point alike; a point's cost is the least of its samples (interference only ever
adds time; the serving path's share of it is measured in situ, stage B). The model is fitted on
the grid and judged on the held-out points; a held-out MAPE above `MAX_HELD_OUT_ERROR` fails the
profile.
"""

from __future__ import annotations

import dataclasses
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from cbserve.planner.cost_model import StepCostModel, relative_errors
from cbserve.planner.grid_journal import GridJournal
from cbserve.planner.step_grid import GridLimits, GridPoint, Measurement, StepGrid, grid, held_out


@dataclass(frozen=True)
class GridSettings:
    quick: bool = True
    passes: int = 3
    repeats: int = 3
    held_out_points: int = 12
    max_batch: int | None = None      # None: min(max_num_seqs, 64)
    max_context: int | None = None    # None: min(max_model_len - 64, 2048)
    seed: int = 0


def _error_stats(model: StepCostModel, measurements: list[Measurement]) -> dict:
    errors = relative_errors(model, [m.shape for m in measurements], [min(m.seconds) for m in measurements])
    by_kind: dict[str, list[float]] = {}
    for m, e in zip(measurements, errors):
        by_kind.setdefault(m.point.kind, []).append(e)
    return {"mape": statistics.mean(errors), "max_error": max(errors), "points": len(errors),
            "by_kind": {k: statistics.mean(v) for k, v in by_kind.items()}}


def grid_points(engine, settings: GridSettings) -> tuple[GridLimits, list[tuple[GridPoint, bool]]]:
    """The limits and the points (point, held out?) that `measure` times on `engine`."""
    sched = engine.scheduler_config
    limits = GridLimits(max_batch=min(sched.max_num_seqs, settings.max_batch or 64),
                        max_context=min(sched.max_model_len - 64, settings.max_context or 2048),
                        max_chunk=sched.max_num_batched_tokens, block_size=engine.cache_config.block_size)
    points = [(p, False) for p in grid(limits, settings.quick)]
    points += [(p, True) for p in held_out(limits, settings.held_out_points, settings.seed + 1)]
    return limits, points


def journal_identity(settings: GridSettings, points: list[tuple[GridPoint, bool]], **more) -> dict:
    """What a `GridJournal`'s measurements must share with a run that resumes it (not `passes`:
    a later run may add passes)."""
    grid_settings = {k: v for k, v in dataclasses.asdict(settings).items() if k != "passes"}
    return {"settings": grid_settings, "points": [f"{p}{' held out' if held else ''}" for p, held in points]} | more


def measure(engine, settings: GridSettings, log=print, timer=None,
            journal: GridJournal | None = None) -> tuple[list[Measurement], list[Measurement]]:
    """(grid, held-out) measurements on `engine`; with a `journal`, the points it holds are taken
    from it and every point measured here goes into it."""
    limits, points = grid_points(engine, settings)
    stepper = StepGrid(engine, settings.repeats, limits.max_context + 64, seed=settings.seed, timer=timer)
    merged: dict[int, Measurement] = {}
    for round_ in range(settings.passes):
        order = list(range(len(points)))
        random.Random(f"{settings.seed}:{round_}").shuffle(order)
        started, kept = time.monotonic(), 0
        for i in order:
            m = journal.get(round_, i, points[i][0]) if journal is not None else None
            if m is None:
                point_started = time.monotonic()
                m = stepper.measure(points[i][0])
                if journal is not None:
                    journal.record(round_, i, m, time.monotonic() - point_started)
            else:
                kept += 1
            old = merged.get(i)
            merged[i] = m if old is None else replace(old, seconds=old.seconds + m.seconds)
        log(f"# profile: grid pass {round_ + 1}/{settings.passes}: {len(points)} points in "
            f"{time.monotonic() - started:.0f} s" + (f" ({kept} of them from the journal)" if kept else ""))
    fit = [merged[i] for i, (_, held) in enumerate(points) if not held]
    held = [merged[i] for i, (_, held) in enumerate(points) if held]
    return fit, held


def fit_model(fit: list[Measurement], held: list[Measurement]) -> tuple[StepCostModel, dict, dict]:
    model = StepCostModel.fit([m.shape for m in fit], [min(m.seconds) for m in fit])
    return model, _error_stats(model, fit), _error_stats(model, held)


def kv_bytes_per_token(engine) -> int:
    """KV bytes one token takes on the wire (every layer, K and V, every KV head)."""
    cfg = engine.model_config
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * engine.kv_cache.element_size()


def describe(engine, args, threads: int, timer: str) -> dict:
    """The profile's identity: device, model, engine flags and what the pods' KV cache holds."""
    import torch

    device = engine.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or
                                                                             platform.machine())
    sched, cache = engine.scheduler_config, engine.cache_config
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cbserve_commit": _git_commit(),
        "device": {"type": device.type, "name": name, "cpu_count": _cpu_count(), "torch": torch.__version__,
                   "threads": threads, "machine": platform.platform()},
        "model": {"name": args.model, "fingerprint": engine.fingerprint, "dtype": str(engine.dtype).removeprefix("torch."),
                  "quantization": engine.quantization, "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
                  "vocab_size": engine.model_config.vocab_size, "num_layers": engine.model_config.num_layers,
                  "layer_windows": list(engine.model_config.layer_windows)},
        "engine": {"max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs,
                   "max_model_len": sched.max_model_len, "block_size": cache.block_size,
                   "num_blocks": cache.num_blocks, "kv_bytes_per_token": kv_bytes_per_token(engine),
                   "tensor_parallel_size": engine.config.tensor_parallel_size,
                   "async_scheduling": engine.async_scheduling, "flags": engine_flags(args),
                   # KV groups (`PodKV`): the flag, the groups `num_blocks` counts pages of, speculation.
                   "kv_cache_groups": cache.kv_cache_groups, "kv_group_windows": list(cache.kv_group_windows),
                   "speculative": engine.config.speculative is not None},
        "timer": timer,
    }


ENGINE_FLAGS = ("device", "dtype", "quantization", "kv_cache_dtype", "max_model_len", "tensor_parallel_size",
                "max_num_batched_tokens", "max_num_seqs", "block_size", "num_blocks", "kv_cache_memory_mb",
                "gpu_memory_utilization", "no_prefix_caching", "policy", "enforce_eager", "no_async_scheduling")


def engine_flags(args) -> dict:
    """The engine flags `cbserve profile` was given (the pods' flags), by name."""
    return {name: getattr(args, name) for name in ENGINE_FLAGS if hasattr(args, name)}


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def grid_json(fit: list[Measurement], held: list[Measurement]) -> dict:
    return {"grid": [m.to_json() for m in fit], "held_out_points": [m.to_json() | {"kind": m.point.kind}
                                                                     for m in held]}


def log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
