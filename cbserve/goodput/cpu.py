"""CPU seconds each process of a local cluster has used, for what a run cost the machine's cores.

On a machine whose cores the pods, the router and the client share (`LocalCluster` on CPU), a
pod's step takes longer when the others want the cores too. The benchmark records each process's
CPU seconds per run, and `cbserve profile` the same for its in-situ runs: the router's and the
client's CPU per output token is what the planner's CPU-sharing model (`planner/cpu_share.py`)
charges the cores besides the steps. A process's figure includes its descendants': a pod's engine
runs in an engine-core child process (`pod.core_client`), and without it a busy pod's CPU read as
a small part of what its steps took. Linux only (`/proc/<pid>/stat`); elsewhere the pods' figures are
absent and the model falls back on the measured contention alone.

`cluster_thread_cpu_seconds` splits a pod's figure by thread (`/proc/<pid>/task/<tid>/stat`): its
server process, the busiest thread of its engine core (the engine thread: it runs every step;
Python 3.11 does not name OS threads, so it is told by its CPU) and the core's other threads (the
writer that builds each step's message, the command reader, the event loop). What a pod's CPU is
made of in overload, steps or the work around them, decides what the cores model charges.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _own_cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS      # utime + stime (fields 14, 15)


def _task_files(pid: int, name: str) -> Iterator[tuple[int, str]]:
    """(tid, text of `/proc/<pid>/task/<tid>/<name>`) for each live thread of `pid` (a thread
    gone meanwhile is skipped)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/{name}") as f:
                yield int(tid), f.read()
        except OSError:
            continue


def _thread_cpu_seconds(pid: int) -> dict[int, float]:
    """tid -> CPU seconds of each live thread of `pid`."""
    out: dict[int, float] = {}
    for tid, stat in _task_files(pid, "stat"):
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 12:
            out[tid] = (int(fields[11]) + int(fields[12])) / _TICKS    # utime + stime
    return out


def _descendants(pid: int) -> list[int]:
    out = []
    for child in _children(pid):
        out += [child] + _descendants(child)
    return out


def _children(pid: int) -> list[int]:
    """The live children of every thread of `pid` (`/proc/<pid>/task/<tid>/children`)."""
    return [int(c) for _, text in _task_files(pid, "children") for c in text.split()]


def _proc_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of `pid` and its live descendants (an exited child's are not counted until
    it is reaped; the engine core lives as long as its pod)."""
    own = _own_cpu_seconds(pid)
    if own is None:
        return None
    return own + sum(_proc_cpu_seconds(child) or 0.0 for child in _children(pid))


def cluster_cpu_seconds(cluster) -> dict[str, float]:
    """name -> CPU seconds so far of each of `cluster`'s processes, and `client` for this one."""
    out = {"client": time.process_time()}
    for name, proc in cluster.processes.items():
        seconds = _proc_cpu_seconds(proc.pid) if proc.pid else None
        if seconds is not None:
            out[name] = seconds
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in after.items() if k in before}


def cluster_thread_cpu_seconds(cluster) -> dict[str, dict[str, dict[int, float]]]:
    """name -> {"server": tid -> CPU seconds, "core": tid -> CPU seconds} of each of `cluster`'s
    processes (the process itself; its descendants, a pod's engine core). Take two and give
    them to `thread_split`."""
    out = {}
    for name, proc in cluster.processes.items():
        if not proc.pid:
            continue
        core: dict[int, float] = {}
        for child in _descendants(proc.pid):
            core |= _thread_cpu_seconds(child)
        out[name] = {"server": _thread_cpu_seconds(proc.pid), "core": core}
    return out


def thread_split(after: dict, before: dict) -> dict[str, dict[str, float]]:
    """name -> the CPU seconds between two `cluster_thread_cpu_seconds` of its server process
    (`server`), of its engine core's busiest thread (`engine`: the engine thread) and of the core's
    other threads (`core_other`). A thread that started in between counts from 0; one that ended
    is not counted."""
    out = {}
    for name, now in after.items():
        then = before.get(name, {"server": {}, "core": {}})
        used = {part: {tid: s - then[part].get(tid, 0.0) for tid, s in now[part].items()} for part in now}
        core = sorted(used["core"].values(), reverse=True)
        out[name] = {"server": sum(used["server"].values()), "engine": core[0] if core else 0.0,
                     "core_other": sum(core[1:])}
    return out
