"""A simulated pod: the real scheduler and KV cache manager, stepped on the virtual clock.

The loop is the engine thread's (`engine.loop.EngineLoop` around `Engine.step`): run the commands
that arrived (intake, KV landed, abort, release), then, if anything is unfinished and the last step
did work (or a command came), `schedule()`, wait the step's cost, `update()` with a token for every
sampled sequence, record the step (`StepStats`, as the engine does), hand the step to the
cluster's role hooks (`on_step`: KV progress, first tokens, pulls to start, tokens out) and wait
the pod's loop gap. A pod with nothing to do waits for a command. What the model computes is
irrelevant to scheduling: requests set `ignore_eos` and `max_tokens`, so every sampled token is the
same placeholder id and lengths alone decide when a request ends.

The pod's KV cache is the engine's for the model and the pod's role (`PodKV.cache`: the engine's
own `serving_cache`, so a mixed local/global model, Gemma 3 or gpt-oss, runs a block table per KV
group and frees its local layers' pages behind their window, unless `--kv-cache-groups single` or
speculation keeps one group), and a pull moves what P/D's `KVSource` moves: each group's pages
from where `KVCacheManager.pull_starts` starts it (`SimPod.pull_pages`).

The step costs `PodCosts.seconds(StepShape.of(out), scale)`: the profiled cost model on the step's shape times
the share of the cores it gets (`cpu_share.CpuShare`, where the pods share a machine's cores) and
the machine's `Jitter` at that instant (`scale`), times the in-situ contention factor: a colocated
pod's decode rows at the decode factor and its prefill chunks at the prefill factor
(`PodCosts.seconds`). The pod's load report is built by the pods' own `build_load_report` from a snapshot refreshed as `PodRuntime.after_step` refreshes it (at most every
`REFRESH_SECONDS` while busy, at once when idle or when its held-KV count changes).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from cbserve.cluster_spec import pod_kv_flags
from cbserve.planner.cost_model import StepCostModel
from cbserve.planner.cpu_share import CpuShare
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_groups.spec import cache_groups, num_pages, serving_cache, serving_groups
from engine.request import Request
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.output import SchedulerOutput
from engine.telemetry.step_shape import StepShape
from engine.telemetry.step_stats import StepStats
from pod.load_report import REFRESH_SECONDS, build_load_report
from wire import cbserve_pb2

SAMPLED_TOKEN_ID = 97          # any id: requests ignore eos and stop on their length
NUM_SNAPSHOT_SAMPLES = 64      # as pod.runtime keeps for its reports


@dataclass(frozen=True)
class PodCosts:
    """How long a simulated pod's steps take."""

    model: StepCostModel
    contention: float = 1.0     # serving's wall seconds per profiled second (in situ)
    step_gap_s: float = 0.0     # the pod's loop between two steps (outputs out, commands in)
    prefill_contention: float | None = None     # a colocated pod's: its steps' prefill part's factor
    row_s: float = 0.0          # each decode row's in-situ cost beyond its profiled share (host work per row)

    def seconds(self, shape: StepShape, scale: float = 1.0) -> float:
        """A step's wall seconds: its profiled cost times `scale` (the cores' share and the
        machine's jitter at that moment) and the contention factor, plus `row_s` per decode row
        (times `scale`: it is CPU work in the step too). A colocated pod's step
        (`prefill_contention` set) is split: its decode rows' cost (`StepShape.decode_part`) at
        the decode factor, the rest (its prefill chunks) at the prefill factor, as a 1P+1D run
        measures them; one factor for the whole step is right only for the mix of the two it was
        fitted on (small int8's colocated pair: 1.23-1.37 on `chat` at stage B's load, 1.01-1.14
        on fixed-256-64 at 2.25-3 req/s, whose steps hold more prefill; decode 1.27-1.45, prefill
        0.59-0.72)."""
        total = self.model.seconds(shape)
        rows = self.row_s * shape.num_decodes
        if self.prefill_contention is None or not shape.prefill_chunks:
            return scale * (total * self.contention + rows)
        decode = self.model.seconds(shape.decode_part()) if shape.num_decodes else 0.0
        return scale * (self.contention * decode + rows + self.prefill_contention * max(0.0, total - decode))


@dataclass(frozen=True)
class PodKV:
    """What a pod's KV cache follows of the model and the pods' flags (`cbserve profile` records
    them): each layer's sliding window (() : every layer full), the layer count, `--kv-cache-groups`,
    whether the decode pods speculate, and how many layers a page of the profiled `num_blocks`
    holds (0: every layer). The default, an old profile's: one group of one "layer" (whole blocks)."""

    num_layers: int = 1
    layer_windows: tuple[int, ...] = ()
    kv_cache_groups: str = "auto"
    speculative: bool = False
    block_layers: int = 0

    def cache(self, role: str, block_size: int, num_blocks: int, prefix_caching: bool) -> CacheConfig:
        """The cache the engine of a pod of `role` runs: its KV groups (or window) as the engine
        decides them, in as many pages as the profiled engine's `num_blocks` pages' memory holds
        (the engine's `--num-blocks` rule)."""
        speculates, mode = pod_kv_flags(role, self.speculative, self.kv_cache_groups)
        base = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching,
                           kv_cache_groups=mode)
        groups, cache = serving_cache(base, self.layer_windows, self.num_layers, role, speculates)
        return replace(cache, num_blocks=num_pages(num_blocks, self.block_layers or self.num_layers, groups))

    def describe(self) -> str:
        """The decode pods' groups, for a log line."""
        if not self.layer_windows:
            return "one KV group" + ("" if self.num_layers > 1 else " (the profile records no layer windows)")
        speculates, mode = pod_kv_flags("decode", self.speculative, self.kv_cache_groups)
        return (serving_groups(self.layer_windows, self.num_layers, "decode", speculates, mode).describe()
                + f" (--kv-cache-groups {self.kv_cache_groups}{', speculating' if speculates else ''})")

    def page_layers(self, cache: CacheConfig) -> int:
        """Layers' KV in one page of `cache` (a message's block: `kvtransfer.layout.KVLayout`)."""
        return cache_groups(self.layer_windows, self.num_layers, cache.kv_group_windows).slots


StepHook = Callable[["SimPod", SchedulerOutput, list[Request]], None]


class Jitter:
    """A shared machine's slow and fast stretches: a factor on every pod's steps, redrawn every
    `period_s` seconds, lognormal with mean 1 and log-spread `sigma` (seeded: a run is
    reproducible). Per-step noise would average out over a request's steps; what spreads TPOT
    and TTFT across requests is whole seconds of a busier machine, which every pod feels at once."""

    def __init__(self, sigma: float, period_s: float = 1.0, seed: int = 0) -> None:
        self.sigma, self.period_s = sigma, period_s
        self._rng = random.Random(f"jitter:{seed}")
        self._factors: list[float] = []

    def factor(self, t: float) -> float:
        if self.sigma <= 0:
            return 1.0
        i = max(0, int(t // self.period_s))
        while len(self._factors) <= i:
            self._factors.append(math.exp(self._rng.gauss(-self.sigma ** 2 / 2, self.sigma)))
        return self._factors[i]


class SimPod:
    """One pod: `submit` commands, `run()` as a task, `load_report()` for the router."""

    def __init__(self, name: str, role: str, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 costs: PodCosts, on_step: StepHook, clock: Callable[[], float], jitter: Jitter | None = None,
                 cpu_share: CpuShare | None = None, page_bytes: int = 0) -> None:
        """`page_bytes`: one KV page (block) of `cache_config` as a pull sends it (`PodShape.page_bytes`)."""
        self.name, self.role = name, role
        self.page_bytes = page_bytes
        self.costs = costs
        self.jitter = jitter
        self.cpu_share = cpu_share
        self.clock = clock
        self.on_step = on_step
        self.cache_config = cache_config
        self.scheduler = Scheduler(scheduler_config, cache_config, role="prefill" if role == "prefill" else "decode",
                                   clock=clock)
        self.stats = StepStats()
        self.commands: list[Callable[[], object]] = []
        self._wake = asyncio.Event()
        self.last_schedule: SchedulerOutput | None = None
        self.busy_seconds = 0.0              # virtual seconds spent in steps (utilisation)
        self.scaled_rows = 0.0               # its steps' decode rows, each times its step's `scale` (stage B's fit)
        # Load reports, as pod.runtime.PodRuntime keeps them.
        self.snapshot = self.stats.snapshot(self.scheduler)
        self.num_held = 0
        self._refreshed_at = float("-inf")
        self._samples: list[tuple[int, object]] = []
        self._last_reported = -1
        self._report: cbserve_pb2.LoadReport | None = None
        self._reported_snapshot = None

    def pull_messages(self, num_prompt_tokens: int, first_block: int, end_block: int) -> tuple[int, int]:
        """Prefill role: (messages, bytes) of what a pull of a prompt of `num_prompt_tokens` tokens
        moves of blocks [first_block, end_block): each KV group's pages from where the pods start
        it (`KVCacheManager.pull_starts`), `page_bytes` each, a message per group with pages (as
        `KVSource` sends a message per group and run of pages)."""
        start, group_starts = self.scheduler.kv_manager.pull_starts(num_prompt_tokens)
        pages = [max(0, end_block - max(first_block, s)) for s in (start, *group_starts)]
        return sum(1 for n in pages if n), sum(pages) * self.page_bytes

    # ------------------------------------------------------------------ commands
    def submit(self, command: Callable[[], object]) -> None:
        """Run `command()` before the pod's next step (as `EngineLoop.call`)."""
        self.commands.append(command)
        self._wake.set()

    def _run_commands(self) -> bool:
        """Run what was submitted; True if anything was."""
        commands, self.commands = self.commands, []
        for command in commands:
            command()
        return bool(commands)

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        scheduler = self.scheduler
        while True:
            costs = self.costs          # (a run may change them between steps: `simulate.sweep`)
            ran = self._run_commands()
            last = self.last_schedule
            if not scheduler.has_unfinished_requests():
                self.last_schedule = None
                self._refresh()
                await self._idle()
                continue
            if last is not None and not last.scheduled and not ran:
                await self._idle()          # waiting for KV or blocks: only a command changes that
                self.last_schedule = None   # woken by one: step
                continue
            out = self.last_schedule = scheduler.schedule()
            sampled: dict[str, int] = {}
            seconds = 0.0
            if out.scheduled:
                scale = 1.0
                if self.cpu_share is not None:
                    scale *= self.cpu_share.factor(self.name)
                if self.jitter is not None:
                    scale *= self.jitter.factor(self.clock())
                shape = StepShape.of(out)
                seconds = costs.seconds(shape, scale)
                self.scaled_rows += scale * shape.num_decodes
                if self.cpu_share is not None:
                    self.cpu_share.stepped(self.name, self.clock(), self.clock() + seconds)
                await asyncio.sleep(seconds)
                sampled = {seq.request_id: SAMPLED_TOKEN_ID for seq in out.scheduled if seq.sample}
            updated = scheduler.update(out, sampled)
            if out.scheduled:
                self.stats.record(out, seconds)
                self.busy_seconds += seconds
            self.on_step(self, out, updated)
            self._after_step()
            if out.scheduled and costs.step_gap_s:
                await asyncio.sleep(costs.step_gap_s)

    async def _idle(self) -> None:
        if not self.commands:
            self._wake.clear()
            await self._wake.wait()

    # ------------------------------------------------------------------ load reports
    def _after_step(self) -> None:
        held = len(self.scheduler.held)
        if held != self.num_held or self.clock() - self._refreshed_at >= REFRESH_SECONDS \
                or not self.scheduler.has_unfinished_requests():
            self._refresh()

    def _refresh(self) -> None:
        self._refreshed_at = self.clock()
        self.snapshot = self.stats.snapshot(self.scheduler)
        self.num_held = len(self.scheduler.held)
        recent = list(self.stats.samples)[-NUM_SNAPSHOT_SAMPLES:]
        base = self.stats.num_steps - len(recent)
        self._samples = [(base + i, s) for i, s in enumerate(recent)]

    def load_report(self) -> cbserve_pb2.LoadReport:
        """The next `WatchLoad` message: the snapshot and the step samples not reported yet."""
        if self._report is not None and self._reported_snapshot is self.snapshot:
            return self._report     # nothing new since the last one (an idle pod): the same message
        samples = [x for n, x in self._samples if n > self._last_reported]
        if self._samples:
            self._last_reported = self._samples[-1][0]
        config = self.scheduler.config
        self._report = build_load_report(self.name, self.role, self.snapshot, samples, draining=False,
                                         block_size=self.scheduler.block_size, max_num_seqs=config.max_num_seqs,
                                         max_num_batched_tokens=config.max_num_batched_tokens,
                                         num_held_kv=self.num_held, timestamp=self.clock())
        self._reported_snapshot = self.snapshot
        return self._report
