"""A simulated cluster end to end: disaggregated and colocated requests finish with their lengths,
the router sees the pods' load reports (its step model fits), cancellations and timeouts free
every KV block on both pods, and overload is refused by the real admission."""

from __future__ import annotations

import asyncio

import pytest

from cbserve.goodput.configs import parse_config
from cbserve.goodput.stats import Slo
from cbserve.goodput.workloads import MIXES, RequestSpec
from cbserve.planner.sim_cluster import SimCluster
from cbserve.planner.simulate import at_rate, sim_model, sweep
from cbserve.planner.virtual_loop import run_virtual
from router.config import RouterConfig


@pytest.fixture(scope="module")
def model():
    from tests.planner.conftest import make_profile

    return sim_model(make_profile())


def _play(model, config: str, requests, slo=(60.0, 60.0), router: RouterConfig | None = None, timeout=60.0):
    async def main():
        cluster = SimCluster(parse_config(config), model.shape, model.pod_costs, model.serving, *slo,
                             prefix_caching=True, request_timeout_s=timeout, router=router)
        await asyncio.sleep(0.2)
        results, elapsed = await cluster.run(requests, model.encode(requests))
        await asyncio.sleep(1.0)              # aborts and releases arrive
        return cluster, results, elapsed
    return run_virtual(main())


def _no_leaks(cluster: SimCluster) -> None:
    for pod in cluster.pods.values():
        s = pod.scheduler
        s.check_invariants()
        assert not s.requests and not s.held, f"{pod.name} still tracks {list(s.requests)}"
        assert s.kv_manager.num_free_blocks == s.kv_manager.block_pool.num_usable_blocks
    assert not cluster.flows


@pytest.mark.parametrize("config", ["1P1D", "colocated-2", "2P1D-round-robin"])
def test_requests_finish_with_their_lengths_and_leave_nothing_behind(model, config):
    requests = [RequestSpec(i, 0.05 * i, "x" * (20 + 37 * i), 1 + 5 * i) for i in range(12)]
    cluster, results, elapsed = _play(model, config, requests)
    assert [r.outcome for r in results] == ["ok"] * 12
    assert [r.num_output_tokens for r in results] == [q.max_tokens for q in requests]
    assert all(r.ttft_s > 0 and r.done_s >= r.last_token_s + 0 for r in results)
    assert elapsed >= max(r.done_s for r in results)
    for state in cluster.dispatcher.tracker.pods.values():
        assert state.report is not None and state.num_inflight == 0
    if config == "1P1D":
        decode = cluster.dispatcher.tracker.pods["decode-0"]
        assert decode.step_model.fitted          # the router's model learnt from the reports
    _no_leaks(cluster)


def test_cancelled_and_timed_out_requests_free_both_pods(model):
    requests = [RequestSpec(i, 0.01 * i, "y" * 300, 200, cancel_after_tokens=3 if i % 2 else None) for i in range(8)]
    cluster, results, _ = _play(model, "1P1D", requests, timeout=0.5)
    outcomes = {r.outcome for r in results}
    assert "cancelled" in outcomes and "timeout" in outcomes
    assert all(r.num_output_tokens == 3 for r in results if r.outcome == "cancelled")
    _no_leaks(cluster)


def test_overload_is_refused_by_the_routers_admission(model):
    requests = [RequestSpec(i, 0.001 * i, f"{i:03d}" + "z" * 400, 64) for i in range(60)]   # no shared prefix
    router = RouterConfig(admission="reject")
    cluster, results, _ = _play(model, "1P1D", requests, slo=(0.2, 0.02), router=router)
    rejected = [r for r in results if r.outcome == "rejected"]
    assert rejected and all(r.http_status == 429 for r in rejected)
    _no_leaks(cluster)


def test_rows_have_the_benchmarks_fields_and_are_reproducible(model):
    from bench.goodput import parse_args  # noqa: F401  (the benchmark's rows are summarize()'s)
    from cbserve.goodput.stats import RunSummary

    rows = sweep(model, "pd-goodput", MIXES["chat"], [1.0, 2.0], 10.0, 0, Slo(0.5, 0.05))
    fields = set(RunSummary.__dataclass_fields__) | {"mix", "config", "sample_errors", "mean_step_s", "latency_calibration"}
    assert [set(r) for r in rows] == [fields, fields]
    assert rows == sweep(model, "pd-goodput", MIXES["chat"], [1.0, 2.0], 10.0, 0, Slo(0.5, 0.05))
    run = at_rate(model, "colocated-2", MIXES["shared-prefix"], 2.0, 10.0, 0, Slo(0.5, 0.05))
    assert run.row["num_requests"] == 20 and set(run.load) == {"colocated"}
    # Equal pods tie and the policy picks at random: seeded, the run repeats.
    assert run.row == at_rate(model, "colocated-2", MIXES["shared-prefix"], 2.0, 10.0, 0, Slo(0.5, 0.05)).row
    assert run.load["colocated"]["running_requests"] > 0
