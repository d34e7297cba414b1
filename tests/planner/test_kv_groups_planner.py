"""KV groups in the planner: a mixed local/global model's pods run the engine's groups.

1. The simulated pod schedules exactly what a real `Engine` of a Gemma 3 / gpt-oss checkpoint
   schedules (test_sim_equivalence's drive, with every group's block table compared): its
   `KVCacheManager` comes from the same `serving_cache` and `--num-blocks` rule as the engine's.
2. A simulated pull moves the bytes the real `KVSource` sends, event by event, per group.
3. The profile carries the model's layer windows (older profiles plan with one group) and
   `--kv-cache-groups` / speculation pick the groups per role as `cbserve up` and the chart do.
4. Capacity: at a long-context workload the grouped plan holds more concurrent decodes than the
   single-group one, by about the ratio of KV the engine's own decode scheduler holds per request.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from cbserve.goodput.configs import parse_config
from cbserve.goodput.workloads import RequestSpec
from cbserve.planner.profile import ProfileError, build_profile, load_profile
from cbserve.planner.sim_cluster import PodShape, SimCluster
from cbserve.planner.sim_pod import PodKV
from cbserve.planner.simulate import sim_model
from cbserve.planner.virtual_loop import run_virtual
from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.request import Request
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler
from tests.planner.conftest import make_profile
from tests.planner.test_sim_equivalence import SCHEDULER, _requests, drive_engine, drive_sim

# Gemma 3 27B's pattern (every 6th layer full) on 12 layers, a 256-token window: pages of 2 layers,
# 1 full group + 5 local ones.
GEMMA_LIKE = tuple(0 if (i + 1) % 6 == 0 else 256 for i in range(12))


# ---------------------------------------------------------------------------------- 1. the same batches
@pytest.fixture(scope="module", params=["gemma3", "gpt_oss"])
def window_model(request, tmp_path_factory):
    from tests.engine.hf_window_models import make_window_model

    path = tmp_path_factory.mktemp(request.param)
    make_window_model(request.param, path)
    return request.param, path


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_a_grouped_pod_schedules_what_the_engine_schedules(window_model, role):
    name, path = window_model
    # Whole-model blocks (--num-blocks), in pages of one layer: small enough to preempt.
    cache = CacheConfig(block_size=16, num_blocks={"gemma3": 6, "gpt_oss": 9}[name])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=str(path), role="decode" if role == "colocated" else role,
                                 max_model_len=SCHEDULER.max_model_len, cache=cache, scheduler=SCHEDULER))
    try:
        cfg = engine.model_config
        kv = PodKV(cfg.num_layers, cfg.layer_windows, block_layers=cfg.num_layers)
        shape = PodShape(SCHEDULER, cache.num_blocks, cache.block_size, 4096, kv)
        sim_cache = shape.cache(True, role)
        # The engine's cache, as the planner builds it: the same groups and pages.
        assert sim_cache == engine.cache_config
        assert len(sim_cache.kv_group_windows) > 1 and sim_cache.num_blocks == cache.num_blocks * cfg.num_layers
        requests = _requests(0)
        real = drive_engine(engine, role, requests)
        simulated = drive_sim(role, requests, sim_cache)
        assert len(real) > 10
        for i, (a, b) in enumerate(zip(real, simulated)):
            assert a == b, f"step {i} differs:\nengine    {a}\nsimulator {b}"
        assert len(real) == len(simulated)
        assert any(seq[5] for step in real for seq in step[1]), "no group tables compared"
        if role != "prefill":
            assert any(step[2] for step in real), "no preemption: the test's pool is not small enough"
        engine.scheduler.check_invariants()
    finally:
        engine.close()
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------- 2. the bytes of a pull
@pytest.mark.parametrize("windows", [GEMMA_LIKE, (64, 0) * 3, ()], ids=["gemma-like", "gpt-oss-like", "dense"])
def test_a_simulated_pull_moves_what_kvsource_sends(windows):
    from kvtransfer.grpc_transport import KVSource
    from kvtransfer.progress import ComputedTokens, FirstToken
    from cbserve.planner.sim_pod import PodCosts, SimPod
    from cbserve.planner.cost_model import FEATURES, StepCostModel

    layers, heads, head_dim, bs = len(windows) or 6, 1, 4, 16
    kv = PodKV(layers, windows, block_layers=layers)
    shape = PodShape(SchedulerConfig(max_num_batched_tokens=128, max_model_len=2048), 64, bs,
                     layers * 2 * heads * head_dim * 4, kv)
    cache = shape.cache(False, "prefill")
    pod = SimPod("prefill-0", "prefill", shape.scheduler, cache, PodCosts(StepCostModel((0.0,) * len(FEATURES))),
                 lambda *a: None, lambda: 0.0, page_bytes=shape.page_bytes(cache))
    s = pod.scheduler
    tensor = torch.zeros(cache.num_blocks, kv.page_layers(cache), 2, bs, heads, head_dim)   # fp32, as the bytes
    num_tokens = 1000
    s.add_request(Request("r", [3 + i % 200 for i in range(num_tokens)], SamplingParams(max_tokens=1, ignore_eos=True)))
    start, group_starts = s.kv_manager.pull_starts(num_tokens)
    events, expected, sent = [], [], 0
    while not s.held:
        out = s.schedule()
        s.update(out, {q.request_id: 97 for q in out.scheduled if q.sample})
        request = s.requests["r"]
        tables = s.kv_manager.group_tables("r")
        if "r" in s.held:
            events.append(FirstToken(97, tuple(request.block_ids), group_block_ids=tables))
            ready = -(-num_tokens // bs)
        else:
            events.append(ComputedTokens(request.num_computed_tokens, tuple(request.block_ids), tables))
            ready = request.num_computed_tokens // bs
        expected.append(pod.pull_messages(num_tokens, sent, ready) if ready > sent else (0, 0))
        sent = max(sent, ready)

    async def stream():
        source = KVSource(tensor, "r", num_tokens, start_block_index=start, group_start_block_indices=group_starts)
        got, queue = [], asyncio.Queue()
        for e in events:
            queue.put_nowait(e)

        async def feed():
            while not queue.empty():
                yield await queue.get()
                await asyncio.sleep(0)        # the source emits before the next event
        async for chunk in source.chunks(feed()):
            got.append(chunk)
        return source.num_bytes_sent, got
    num_bytes, chunks = asyncio.run(stream())
    assert num_bytes == sum(b for _, b in expected) > 0
    # As many groups send as the planner charges a message for (the real source may split a
    # group's pages into several runs).
    assert len({c.kv_group for c in chunks if c.num_blocks}) == max(m for m, _ in expected)
    if windows == GEMMA_LIKE:      # the local groups send a window's pages, not the prompt's
        single = PodKV(layers, windows, "single", block_layers=layers)
        one = dataclasses.replace(shape, kv=single)
        one_pod = SimPod("p", "prefill", one.scheduler, one.cache(False, "prefill"),
                         PodCosts(StepCostModel((0.0,) * len(FEATURES))), lambda *a: None, lambda: 0.0,
                         page_bytes=one.page_bytes(one.cache(False, "prefill")))
        # 63 blocks x 12 layers against 63 x 2 (the full group) + 5 groups x 17 pages x 2 layers.
        assert one_pod.pull_messages(num_tokens, 0, -(-num_tokens // bs))[1] * 296 == num_bytes * 756


# ---------------------------------------------------------------------------------- 3. profile and flags
def _grouped_profile(windows=GEMMA_LIKE, num_blocks=1100, max_model_len=4096, kv_group_windows=None, **engine):
    profile = make_profile()
    data = dict(profile.data)
    data["model"] = dict(data["model"], num_layers=len(windows), layer_windows=list(windows))
    data["engine"] = dict(data["engine"], num_blocks=num_blocks, max_model_len=max_model_len,
                          kv_bytes_per_token=len(windows) * 2 * 2 * 64 * 2,
                          kv_group_windows=list(kv_group_windows or ()), **engine)
    return build_profile(data, profile.cost_model, profile.serving)


def test_the_profile_carries_the_groups_and_old_profiles_plan_with_one(tmp_path):
    old = make_profile()
    assert old.shape().kv == PodKV() and old.shape().cache(True, "decode").kv_group_windows == ()
    grouped = _grouped_profile()
    path = tmp_path / "p.json"
    grouped.save(path)
    shape = load_profile(path).shape()
    decode = shape.cache(True, "decode")
    assert decode.kv_group_windows == (0,) + (256,) * 5
    assert decode.num_blocks == 1100 * 12 // 2            # the single-group profile's memory, in pages
    assert shape.page_bytes(decode) == shape.kv_bytes_per_token * 16 // 6
    # --kv-cache-groups single on the plan, or a profile of a grouped engine planned single.
    assert load_profile(path).shape(kv_cache_groups="single").cache(True, "decode").num_blocks == 1100
    regrouped = _grouped_profile(num_blocks=6600, kv_group_windows=(0,) + (256,) * 5)
    assert regrouped.shape().cache(True, "prefill").num_blocks == 6600
    assert regrouped.shape(kv_cache_groups="single").cache(True, "prefill").num_blocks == 1100
    # Speculating decode pods keep one group, and so do the prefill pods that pair with them.
    spec = _grouped_profile(speculative=True).shape()
    assert {role: spec.cache(True, role).kv_group_windows for role in ("prefill", "decode")} == \
        {"prefill": (), "decode": ()}
    bad = dict(grouped.data, model=dict(grouped.data["model"], layer_windows=[0, 256]))
    (tmp_path / "bad.json").write_text(__import__("json").dumps(bad))
    with pytest.raises(ProfileError, match="layer_windows"):
        load_profile(tmp_path / "bad.json")


def test_cluster_spec_and_planner_share_the_speculation_rule():
    from cbserve.cluster_spec import ClusterSpec

    spec = ClusterSpec(model="m", port=0, num_prefill=1, num_decode=1, speculative_config='{"method": "ngram"}')
    prefill = spec.pod_argv("prefill-0", "prefill", 1, 2, 3)
    decode = spec.pod_argv("decode-0", "decode", 1, 2, 3)
    assert "--kv-cache-groups" in prefill and prefill[prefill.index("--kv-cache-groups") + 1] == "single"
    assert "--speculative-config" in decode and "--kv-cache-groups" not in decode
    assert "--kv-cache-groups" not in ClusterSpec(model="m", port=0, num_prefill=1, num_decode=1).pod_argv(
        "prefill-0", "prefill", 1, 2, 3)


# ---------------------------------------------------------------------------------- 4. capacity
def _engine_layer_blocks(cache: CacheConfig, kv: PodKV, prompt: int, output: int) -> float:
    """The KV one request holds on the engine's own decode-role scheduler (reserved, landed,
    decoded to its end), in layer-blocks (pages x layers per page), averaged over its decode
    steps: what a decode pod full of such requests at every age holds per request."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_model_len=4096),
                  dataclasses.replace(cache, num_blocks=4000), role="decode")
    pool = s.kv_manager.block_pool
    s.add_remote_request(Request("r", [3] * prompt, SamplingParams(max_tokens=output, ignore_eos=True)))
    held = []
    while s.has_unfinished_requests():
        out = s.schedule()
        for rid in out.reserved_request_ids:
            s.remote_kv_landed(rid, 97)
        s.update(out, {q.request_id: 97 for q in out.scheduled if q.sample})
        if out.scheduled:
            held.append(pool.num_usable_blocks - pool.num_free_blocks)
    return sum(held) / len(held) * kv.page_layers(cache)


def _saturated_decodes(model, requests) -> float:
    """The decode pod's mean batch while requests wait for its KV (1P1D, every SLO loose)."""
    async def main():
        cluster = SimCluster(parse_config("1P1D"), model.shape, model.pod_costs, model.serving, 600.0, 600.0,
                             prefix_caching=False, request_timeout_s=600.0)
        s = cluster.pods["decode-0"].scheduler
        batches = []

        async def watch():
            while True:
                if s.waiting_for_blocks or s.waiting:
                    batches.append(len(s.running))
                await asyncio.sleep(0.05)
        watcher = asyncio.get_running_loop().create_task(watch())
        await asyncio.sleep(0.2)
        results, _ = await cluster.run(requests, model.encode(requests))
        watcher.cancel()
        cluster.close()
        assert [r.outcome for r in results] == ["ok"] * len(requests)
        assert s.num_preemptions and len(batches) > 50      # KV-bound for a good while
        return sum(batches) / len(batches)
    return run_virtual(main())


def test_a_grouped_plan_holds_more_long_decodes_by_the_engines_kv_ratio():
    prompt, output = 2000, 1024
    profile = _grouped_profile(num_blocks=1100)
    # Cheap prefill, long answers: the decode pod's KV, not the prefill pod, bounds its batch.
    costs = {k: dataclasses.replace(c, model=dataclasses.replace(c.model, coefficients=(0.004, 0.01) + (0.0,) *
                                                                 (len(c.model.coefficients) - 2)))
             for k, c in profile.pod_costs().items()}
    requests = [RequestSpec(i, 0.001 * i, "a" * (prompt - 1), output) for i in range(48)]   # + bos: `prompt`
    batches, held = {}, {}
    for mode in ("auto", "single"):
        model = dataclasses.replace(sim_model(profile, kv_cache_groups=mode), pod_costs=costs)
        shape = model.shape
        batches[mode] = _saturated_decodes(model, requests)
        held[mode] = _engine_layer_blocks(shape.cache(False, "decode"), shape.kv, prompt, output)
    kv_ratio = held["single"] / held["auto"]
    assert 3.5 < kv_ratio < 4.5                    # 12 layers' KV per block against 2 + 5 windows'
    ratio = batches["auto"] / batches["single"]
    assert batches["single"] >= 5 and ratio == pytest.approx(kv_ratio, rel=0.15), (batches, kv_ratio)
