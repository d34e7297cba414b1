"""The `LoadReport` a pod streams to the router (`WatchLoad`, `GetLoad`), built from an engine snapshot.

One function, so a pod and the capacity planner's simulated pods (`cbserve.planner`) report the
same fields the same way: the router's `PodState.apply_report` cannot tell them apart.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.lora.stats import stats_to_pb as lora_stats_to_pb
from engine.outputs import EngineStats, StepSample
from wire import cbserve_pb2

MAX_SAMPLES_PER_REPORT = 32   # newest step samples a report carries
REFRESH_SECONDS = 0.05        # snapshot age bound while busy; WatchLoad's default interval


def build_load_report(pod_id: str, role: str, stats: EngineStats, samples: Sequence[StepSample], *,
                      draining: bool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                      num_held_kv: int, timestamp: float | None = None) -> cbserve_pb2.LoadReport:
    """`samples`: the steps not reported yet, oldest first (the newest `MAX_SAMPLES_PER_REPORT` go);
    `timestamp`: unix seconds (None: now)."""
    report = cbserve_pb2.LoadReport(
        pod_id=pod_id, role=role, num_waiting=stats.num_waiting, num_running=stats.num_running,
        prefill_queue_tokens=stats.prefill_queue_tokens, num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks, step_seconds_ewma=stats.step_seconds_ewma,
        prefill_tokens_per_second=stats.prefill_tokens_per_second,
        timestamp=time.time() if timestamp is None else timestamp, draining=draining, block_size=block_size,
        max_num_seqs=max_num_seqs, num_held_kv=num_held_kv, max_loras=stats.max_loras,
        max_num_batched_tokens=max_num_batched_tokens,
        step_samples=[cbserve_pb2.StepSample(num_seqs=x.num_seqs, num_context_tokens=x.num_context_tokens,
                                             num_prefill_tokens=x.num_prefill_tokens, seconds=x.seconds)
                      for x in samples[-MAX_SAMPLES_PER_REPORT:]])
    lora_stats_to_pb(stats.lora_adapters, report.lora_adapters)
    return report
