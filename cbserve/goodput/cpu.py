"""CPU seconds each process of a local cluster has used, for what a run cost the machine's cores.

On a machine whose cores the pods, the router and the client share (`LocalCluster` on CPU), a
pod's step takes longer when the others want the cores too. The benchmark records each process's
CPU seconds per run, and `cbserve profile` the same for its in-situ runs: the router's and the
client's CPU per output token is what the planner's CPU-sharing model (`planner/cpu_share.py`)
charges the cores besides the steps. A process's figure includes its descendants': a pod's engine
runs in an engine-core child process (`pod.core_client`), and without it a busy pod's CPU read as
a small part of what its steps took. Linux only (`/proc/<pid>/stat`); elsewhere the pods' figures are
absent and the model falls back on the measured contention alone.
"""

from __future__ import annotations

import os
import time

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _own_cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS      # utime + stime (fields 14, 15)


def _children(pid: int) -> list[int]:
    """The live children of every thread of `pid` (`/proc/<pid>/task/<tid>/children`)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


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
