"""Stage B's fit recovers a serving path it did not see: probes played on a simulated cluster with
known overheads, contention and KV bandwidth, then fitted as if they had been measured."""

from __future__ import annotations

import pytest

from cbserve.planner.in_situ import _fit_probes, _serving_from_probes, probe_requests
from cbserve.planner.profile import ServingProfile, with_serving
from cbserve.planner.in_situ import _simulate

TRUTH = ServingProfile(contention=2.0, prefill_contention=2.0, http_in_s=0.003, rpc_s=0.002, token_out_s=0.005,
                       kv_message_s=0.004, kv_bytes_per_s=40e6)


def test_probes_recover_path_contention_and_kv_bandwidth(profile):
    probes = probe_requests(profile, repeats=2, seed=0)
    measured, _ = _simulate(with_serving(profile, TRUTH), probes)
    assert all(r.outcome == "ok" for r in measured)
    fit = _fit_probes(profile, probes, measured)
    assert fit["prefill_contention_alone"] == pytest.approx(2.0, rel=0.05)
    assert fit["decode_contention_alone"] == pytest.approx(2.0, rel=0.1)
    assert fit["ttft_overhead_s"] == pytest.approx(0.010, abs=0.002)
    serving = _serving_from_probes(fit, profile.engine["kv_bytes_per_token"])
    assert serving.kv_bytes_per_s == pytest.approx(40e6, rel=0.2)
    assert serving.kv_message_s == pytest.approx(0.004, abs=0.003)
    assert serving.http_in_s + serving.rpc_s + serving.token_out_s == pytest.approx(0.010, abs=0.002)


def test_probes_run_one_at_a_time(profile):
    probes = probe_requests(profile, repeats=2, seed=1)
    assert len(probes) == 12 and {p.max_tokens for p in probes} == {2, 24}
    measured, _ = _simulate(with_serving(profile, TRUTH), probes)
    spans = sorted((r.sent_s, r.done_s) for r in measured)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))     # no overlap: each alone on the cluster


def test_cores_shared_by_steps_and_serving_slow_a_step_down():
    from cbserve.planner.cpu_share import CpuShare, CpuShareCosts

    now = [0.0]
    share = CpuShare(CpuShareCosts(cores=2, cpu_per_token_s=0.001), lambda: now[0])
    assert share.factor("a") == 1.0                   # alone: a core to itself
    share.stepped("b", 0.0, 10.0)                     # b steps throughout
    now[0] = 1.0
    assert share.factor("a") == 1.0                   # a and b: one core each
    for _ in range(1000):                             # 1000 tokens in the last second: one more core wanted
        share.serving_work(1)
    assert share.factor("a") == pytest.approx(1.5)    # 3 wanting, 2 cores
    now[0] = 2.5                                      # the tokens are out of the window again
    assert share.factor("a") == 1.0
    assert CpuShare(CpuShareCosts(cores=0), lambda: 0.0).factor("a") == 1.0


def test_the_cores_are_shared_max_min_fairly():
    """What wants less than an equal split gets all of it; the rest split what is left (a colocated-2
    cluster at its knee, measured by thread: engines 97% busy, serving 0.53 cores of 2, an engine
    thread's step wall 1.35x its CPU, where c/n, 1.25x, was short)."""
    from cbserve.planner.cpu_share import fair_share

    assert fair_share([], 2) == 1.0 and fair_share([0.5], 2) == 1.0          # room for everyone
    assert fair_share([0.53, 0.97], 2) == pytest.approx(0.735)               # 1 / 0.735 = 1.36
    assert fair_share([0.2, 1.0, 1.0], 2) == pytest.approx(0.6)              # three engines share 1.8
    assert fair_share([3.0], 2) == pytest.approx(1.0)                        # one heavy other: half each
    assert fair_share([1.0, 1.0, 1.0, 1.0], 2) == pytest.approx(0.4)
    assert fair_share([0.1], 0.5) == pytest.approx(0.4)                      # less than a core left


def test_serving_cpu_per_token_is_what_the_processes_used_beyond_the_engine_threads(profile):
    """The serving path's CPU is every process's less the pods' engine threads' (by thread where
    recorded, else at most the pods' step seconds): a step's in-situ excess over the profiled cost
    is its role's contention, not serving work. Each kind of cluster has its own run and rate."""
    from cbserve.goodput.workloads import MIXES
    from cbserve.planner.in_situ import InSituSettings, _fit_cpu, _result_json

    settings = InSituSettings(seconds=2.0)
    requests = MIXES[settings.mix].requests(1.0, settings.seconds, settings.seed)
    results, _ = _simulate(with_serving(profile, ServingProfile()), requests)
    tokens = sum(r.num_output_tokens for r in results)
    load = [_result_json(r) for r in results]
    # 1P1D: the pods spent 5 s in steps (more than any profiled cost: in situ a step takes longer)
    # and 0.001 s per token besides; the router 0.002 s per token.
    cpu = {"router": 0.002 * tokens, "prefill-0": 1.0, "decode-0": 4.0 + 0.001 * tokens, "client": 0.0, "wall": 9.0}
    steps = {"prefill": [1.0, 3], "decode": [4.0, 40]}
    # colocated-2, recorded by thread: engine threads 6 s, everything else 0.0005 s per token.
    threads = {"colocated-0": {"server": 0.0, "engine": 3.5, "core_other": 0.0},
               "colocated-1": {"server": 0.0, "engine": 2.5, "core_other": 0.0}}
    colocated = {"load_rate": 1.0, "load": load, "step_seconds": {"colocated": [9.0, 50]}, "cpu_threads": threads,
                 "cpu_seconds": {"router": 0.0005 * tokens, "colocated-0": 3.5, "colocated-1": 2.5, "wall": 9.0}}
    raw = {"load_rate": 1.0, "load": load, "cpu_seconds": cpu, "step_seconds": steps, "colocated": colocated}
    fitted = _fit_cpu(profile, raw, settings, ServingProfile())
    assert fitted.cores == 2 and fitted.cpu_per_token_s == pytest.approx(0.003, rel=1e-6)
    assert fitted.colocated_cpu_per_token_s == pytest.approx(0.0005, rel=1e-6)
    costs = fitted.costs().cpu
    assert costs.of(colocated=True).cpu_per_token_s == pytest.approx(0.0005, rel=1e-6)
    assert costs.of(colocated=False).cpu_per_token_s == pytest.approx(0.003, rel=1e-6)
    # Steps that waited for a core (wall above the pods' CPU): the pods' CPU is the bound.
    waited = raw | {"step_seconds": {"prefill": [3.0, 3], "decode": [40.0, 40]}, "colocated": None}
    assert _fit_cpu(profile, waited, settings, ServingProfile()).cpu_per_token_s == pytest.approx(0.002, rel=1e-6)
    assert _fit_cpu(profile, raw | {"cpu_seconds": None, "colocated": None}, settings, ServingProfile()).cores == 0


def test_the_serving_paths_base_cores_want_a_core_whatever_it_streams():
    from cbserve.planner.cpu_share import CpuShare, CpuShareCosts

    now = [0.0]
    costs = CpuShareCosts(cores=2, cpu_per_token_s=0.001, serving_cores=0.5, colocated_serving_cores=0.2)
    share = CpuShare(costs, lambda: now[0])
    assert share.factor("a") == 1.0                   # 1.5 wanting, 2 cores
    share.stepped("b", 0.0, 10.0)
    now[0] = 1.0
    assert share.factor("a") == pytest.approx(4 / 3)  # half a core of timers met; a and b split the 1.5 left
    assert costs.of(colocated=True).serving_cores == 0.2 and costs.of(colocated=False).serving_cores == 0.5
    assert CpuShareCosts(serving_cores=0.5).of(colocated=True).serving_cores == 0.5   # no colocated base: the same


def test_the_serving_cpu_is_a_base_and_a_cost_per_token_fitted_through_every_run_of_a_kind(profile):
    """Three 1P+1D runs at different token rates (the calibration mix, `long-output`, `long-prompt`)
    whose serving path used 0.3 cores plus 0.2 ms a token, and two colocated-2 runs at 0.25 cores
    plus 0.3 ms: both lines come back, where one run's CPU per token would be several times the
    per-token cost at a high token rate. One run of a kind (older profiles): through the origin."""
    from cbserve.goodput.workloads import MIXES
    from cbserve.planner.in_situ import InSituSettings, _fit_cpu, _result_json

    settings = InSituSettings(seconds=4.0)

    def run(mix: str, rate: float, wall: float, base: float, per_token: float, pods: tuple[str, ...]) -> dict:
        requests = MIXES[mix].requests(rate, settings.seconds, settings.seed)
        results, _ = _simulate(with_serving(profile, ServingProfile()), requests)
        tokens = sum(r.num_output_tokens for r in results)
        threads = {pod: {"server": 0.0, "engine": 2.0, "core_other": 0.0} for pod in pods}
        cpu = {pod: 2.0 for pod in pods} | {"router": base * wall + per_token * tokens, "client": 0.0, "wall": wall}
        return {"mix": mix, "load_rate": rate, "load": [_result_json(r) for r in results], "cpu_seconds": cpu,
                "cpu_threads": threads, "step_seconds": {}}

    pd, colocated = ("prefill-0", "decode-0"), ("colocated-0", "colocated-1")
    raw = run("chat", 1.0, 6.0, 0.3, 0.0002, pd) | {
        "decode_high": run("long-output", 8.0, 7.0, 0.3, 0.0002, pd),
        "prefill_high": run("long-prompt", 1.0, 5.0, 0.3, 0.0002, pd),
        "colocated": run("chat", 2.0, 6.0, 0.25, 0.0003, colocated),
        "colocated_high": run("chat", 6.0, 6.5, 0.25, 0.0003, colocated)}
    fitted = _fit_cpu(profile, raw, settings, ServingProfile())
    assert fitted.serving_cores == pytest.approx(0.3, rel=1e-6)
    assert fitted.cpu_per_token_s == pytest.approx(0.0002, rel=1e-6)
    assert fitted.colocated_serving_cores == pytest.approx(0.25, rel=1e-6)
    assert fitted.colocated_cpu_per_token_s == pytest.approx(0.0003, rel=1e-6)
    calibration = raw["cpu_seconds"]["router"] / sum(r["num_output_tokens"] for r in raw["load"])
    assert calibration > 3 * fitted.cpu_per_token_s
    costs = fitted.costs().cpu
    assert costs.of(colocated=True).serving_cores == pytest.approx(0.25) and costs.serving_cores == pytest.approx(0.3)
    assert ServingProfile.from_json(fitted.to_json()) == fitted       # the file keeps both lines
    assert ServingProfile.from_json({k: v for k, v in fitted.to_json().items()
                                     if "serving_cores" not in k}).costs().cpu.serving_cores == 0.0   # older files
    older = {k: v for k, v in raw.items() if k not in ("decode_high", "prefill_high", "colocated_high")}
    fitted = _fit_cpu(profile, older, settings, ServingProfile())
    assert fitted.serving_cores == 0.0 and fitted.cpu_per_token_s == pytest.approx(calibration, rel=1e-6)


def test_a_one_pod_cluster_steps_at_the_lone_pods_contention_and_the_file_keeps_it(tmp_path):
    """`alone_contention` (stage B's colocated-1 run) is colocated-1's; colocated-2 keeps the
    colocated factor; a profile without it plans colocated-1 as before."""
    from cbserve.goodput.workloads import MIXES
    from cbserve.planner.in_situ import ALONE, COLOCATED
    from cbserve.planner.profile import load_profile

    from tests.planner.conftest import make_profile

    requests = MIXES["chat"].requests(0.5, 4.0, 0)
    mean_step = {}
    for alone in (None, 3.0):
        profile = make_profile(ServingProfile(colocated_contention=1.0, alone_contention=alone))
        path = tmp_path / f"p{alone}.json"
        profile.save(path)
        profile = load_profile(path)
        assert profile.serving.alone_contention == alone
        for name, fields in (("colocated-1", ALONE), ("colocated-2", COLOCATED)):
            _, steps = _simulate(profile, requests, fields)
            busy, n = steps["colocated"]
            mean_step[(alone, name)] = busy / n
    assert mean_step[(3.0, "colocated-1")] == pytest.approx(3 * mean_step[(None, "colocated-1")], rel=0.02)
    assert mean_step[(3.0, "colocated-2")] == pytest.approx(mean_step[(None, "colocated-2")], rel=1e-9)


def _stage_b_raw(profile, truth: ServingProfile, settings, runs) -> dict:
    """Stage B's raw measurements as a cluster stepping at `truth` would give them: the probes, and
    per `(key, cluster fields, rate[, mix])` a load run (key None: the 1P+1D run, at the top level;
    the mix: the settings' calibration mix unless given)."""
    from cbserve.goodput.workloads import MIXES
    from cbserve.planner.in_situ import _result_json

    probes = probe_requests(profile, settings.probe_repeats, settings.seed)
    raw = {"probes": [_result_json(r) for r in _simulate(with_serving(profile, truth), probes)[0]]}
    for key, fields, rate, *mix in runs:
        mix = mix[0] if mix else settings.mix
        requests = MIXES[mix].requests(rate, settings.seconds, settings.seed)
        results, steps = _simulate(with_serving(profile, truth), requests, fields)
        run = {"load_rate": rate, "load": [_result_json(r) for r in results], "step_seconds": steps}
        raw |= run if key is None else {key: run | {"mix": mix}}
    return raw


def test_colocated_and_alone_contention_are_the_fixed_point_that_reproduces_the_mean_step(profile):
    """A stage B whose runs the simulator made at known factors (colocated 1.7, alone 1.5; the
    1P+1D run's decode and prefill 2.0): the fit finds them again within 2%. The one ratio at
    factor 1 (the colocated and alone fit up to session 8) is off by more: at 1.0 the batches are
    smaller and the mean step shorter than the run's."""
    from dataclasses import replace

    from cbserve.goodput.workloads import MIXES
    from cbserve.planner.in_situ import ALONE, COLOCATED, PD, InSituSettings, fit_in_situ

    settings = InSituSettings(seconds=8.0, probe_repeats=1)
    truth = replace(TRUTH, colocated_contention=1.7, alone_contention=1.5)
    raw = _stage_b_raw(profile, truth, settings, ((None, PD, 2.0), ("colocated", COLOCATED, 7.2), ("alone", ALONE, 3.2)))

    serving = fit_in_situ(profile, raw, settings).serving
    assert serving.colocated_contention == pytest.approx(1.7, rel=0.02)
    assert serving.alone_contention == pytest.approx(1.5, rel=0.02)
    assert serving.contention == pytest.approx(2.0, rel=0.02)          # the 1P+1D run's, the same helper's
    assert serving.prefill_contention == pytest.approx(2.0, rel=0.02)
    for key, fields, field, fitted in (("colocated", COLOCATED, "colocated_contention", 1.7),
                                       ("alone", ALONE, "alone_contention", 1.5)):
        requests = MIXES[settings.mix].requests(raw[key]["load_rate"], settings.seconds, settings.seed)
        _, steps = _simulate(with_serving(profile, replace(serving, **{field: 1.0})), requests, fields)
        total, count = raw[key]["step_seconds"]["colocated"]
        busy, n = steps["colocated"]
        one_ratio = (total / count) / (busy / n)
        assert abs(one_ratio / fitted - 1) > 0.04, (field, one_ratio)


def test_fixed_point_stays_in_its_bracket_where_the_plain_rounds_swing_apart():
    """A mean step as steep as f^3 in its factor (plain f <- f x measured / simulated(f) goes
    1, 8, 1/8, 512, ...): the bracketed rounds close in on f = 2; a name with no measurement keeps
    its factor; a linear mean step is found in one round."""
    from cbserve.planner.in_situ import fixed_point

    calls = []

    def steep(factors):
        calls.append(dict(factors))
        return {"a": factors["a"] ** 3, "b": 1.0}

    factors = fixed_point({"a": 8.0}, steep, {"a": 1.0, "b": 3.0})
    assert factors["a"] == pytest.approx(2.0, rel=0.03) and factors["b"] == 3.0
    assert all(0.99 < c["a"] < 8.01 for c in calls)     # never outside the first bracket [1, 8]
    assert fixed_point({"a": 6.0}, lambda f: {"a": 2.0 * f["a"]}, {"a": 1.0}) == {"a": 3.0}
    # A name already there while another is not keeps its factor (an exact 1 once sent it to 0).
    assert fixed_point({"a": 6.0, "b": 1.0}, lambda f: {"a": 2.0 * f["a"], "b": f["b"]}, {"a": 1.0, "b": 1.0}) \
        == {"a": 3.0, "b": 1.0}


def test_a_colocated_step_is_split_by_part_at_the_disaggregated_factors(tmp_path):
    """With `colocated_split` a colocated pod's mixed step is its decode rows' cost at the decode
    factor plus the rest (its prefill chunks) at the prefill factor; a decode-only step is all at
    the decode factor. A serving section written before the field (an old profile) loads without
    it: every role, colocated too, steps at its one factor as before."""
    import json

    from cbserve.planner.profile import load_profile
    from engine.telemetry.step_shape import StepShape

    from tests.planner.conftest import make_profile

    serving = ServingProfile(contention=1.5, prefill_contention=0.6, colocated_contention=1.1, alone_contention=1.3,
                             colocated_split=True)
    path = tmp_path / "new.json"
    make_profile(serving).save(path)
    data = json.loads(path.read_text())
    assert data["serving"]["colocated_split"] is True
    del data["serving"]["colocated_split"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    mixed = StepShape(4, 400, 100, 100, prefill_chunks=((200, 0),), num_sampled=5)
    decodes = mixed.decode_part()
    assert decodes == StepShape(4, 400, 100, 100, (), 4)
    new, old = load_profile(path), load_profile(tmp_path / "old.json")
    assert old.serving.colocated_split is False
    model = new.cost_model
    whole, decode = model.seconds(mixed), model.seconds(decodes)
    assert 0 < decode < whole
    costs = new.pod_costs()
    assert costs["colocated"].seconds(mixed) == pytest.approx(1.5 * decode + 0.6 * (whole - decode), rel=1e-12)
    assert costs["colocated"].seconds(decodes) == pytest.approx(1.5 * decode, rel=1e-12)
    assert costs["colocated"].seconds(mixed, scale=2.0) == pytest.approx(2 * (1.5 * decode + 0.6 * (whole - decode)))
    for role, factor in (("decode", 1.5), ("prefill", 0.6), ("alone", 1.3)):
        assert costs[role].seconds(mixed) == pytest.approx(factor * whole, rel=1e-12)
    for role, factor in (("decode", 1.5), ("prefill", 0.6), ("alone", 1.3), ("colocated", 1.1)):
        assert old.pod_costs()[role].seconds(mixed) == pytest.approx(factor * whole, rel=1e-12)


def test_stage_b_checks_the_split_on_both_colocated_runs(profile):
    """Colocated pods that really step by part (decode 2.0, prefill 2.0 x 0.5), run at a light
    and a heavy load: the fitted profile splits, reproduces both runs' mean steps, and records
    each run's own one factor, which falls as the heavier load's steps take more prefill."""
    from dataclasses import replace

    from cbserve.planner.in_situ import COLOCATED, PD, InSituSettings, fit_in_situ

    settings = InSituSettings(seconds=8.0, probe_repeats=1)
    truth = replace(TRUTH, prefill_contention=1.0, colocated_split=True)
    raw = _stage_b_raw(profile, truth, settings,
                       ((None, PD, 2.0), ("colocated", COLOCATED, 2.0), ("colocated_high", COLOCATED, 14.0)))
    serving = fit_in_situ(profile, raw, settings).serving
    assert serving.colocated_split        # (the 1P+1D factors as the fit finds them: 1.9 and 0.9 here)
    assert serving.contention == pytest.approx(2.0, rel=0.1) and serving.prefill_contention == pytest.approx(1.0, rel=0.15)
    low, high = serving.in_situ["colocated_check"]
    for run in (low, high):
        assert run["simulated_step_s"] == pytest.approx(run["measured_step_s"], rel=0.05)
    assert low["factor"] > high["factor"] + 0.05

def test_the_second_colocated_rate_is_above_the_first(profile):
    """The knee run's rate comes from a finer ladder above the first run's, so it is never the same."""
    from cbserve.planner.in_situ import COLOCATED, HIGHER_RATE, InSituSettings, _load_rate

    settings = InSituSettings(seconds=4.0)
    low = _load_rate(profile, settings, COLOCATED, 0.6)
    high = _load_rate(profile, settings, COLOCATED, 0.95, start=low * HIGHER_RATE, growth=HIGHER_RATE)
    assert high >= low * HIGHER_RATE


def test_a_decode_rows_cost_is_fitted_from_the_two_1p1d_runs(profile):
    """Decode pods that pay 0.4 ms a row beyond 1.5 x their profiled step: stage B's `chat` run
    (a row or two a step) and its `long-output` run (many rows, at the rate `_rows_rate` picks)
    give back both within 10%, and the simulated mean steps of both runs within 2%, where each
    run's own one factor differs (larger at more rows). Without the second run (an older stage
    B) there is no row cost: one factor, as before."""
    from dataclasses import replace

    from cbserve.planner.in_situ import PD, InSituSettings, _rows_rate, fit_in_situ

    settings = InSituSettings(seconds=8.0, probe_repeats=1)
    truth = replace(TRUTH, contention=1.5, decode_row_s=0.0004)
    rate = _rows_rate(with_serving(profile, ServingProfile()), settings, 2.0)
    assert rate > 2.0
    raw = _stage_b_raw(profile, truth, settings, ((None, PD, 2.0), ("decode_high", PD, rate, settings.rows_mix)))
    serving = fit_in_situ(profile, raw, settings).serving
    assert serving.decode_row_s == pytest.approx(0.0004, rel=0.1)
    assert serving.contention == pytest.approx(1.5, rel=0.1)
    low, high = serving.in_situ["decode_check"]
    assert high["rows_per_step"] >= settings.target_rows > 3 * low["rows_per_step"]
    for run in (low, high):
        assert run["simulated_step_s"] == pytest.approx(run["measured_step_s"], rel=0.02)
    assert high["factor"] > low["factor"] + 0.1
    assert serving.in_situ["decode_high"] == {"mix": "long-output", "load_rate": rate}
    assert profile.pod_costs()["decode"].row_s == 0.0
    costs = with_serving(profile, serving).pod_costs()
    assert costs["decode"].row_s == serving.decode_row_s and costs["prefill"].row_s == 0.0

    del raw["decode_high"]
    older = fit_in_situ(profile, raw, settings).serving
    assert older.decode_row_s == 0.0 and older.in_situ["decode_high"] is None
    assert len(older.in_situ["decode_check"]) == 1


def test_the_prefill_factor_is_fitted_on_the_run_whose_prefill_pod_is_busy(profile):
    """A prefill pod at 2.0x its profiled steps in the calibration run (idle most of the time) and
    at 1.4x in stage B's third run (`long-prompt`, at the rate `_load_rate` gives for a prefill pod
    busy 60% of the time): the profile keeps 1.4, the check reports both runs' own factors and the
    prefill run's mean step within 2%. Without the third run (an older stage B), the calibration
    run's factor, as before."""
    from dataclasses import replace

    from cbserve.planner.in_situ import PD, InSituSettings, _load_rate, fit_in_situ

    settings = InSituSettings(seconds=8.0, probe_repeats=1)
    rate = _load_rate(with_serving(profile, ServingProfile()), settings, target_busy=settings.prefill_busy,
                      mix=settings.prefill_mix, role="prefill")
    busier = _load_rate(with_serving(profile, ServingProfile()), settings, target_busy=0.9,
                        mix=settings.prefill_mix, role="prefill")
    assert busier > rate > 0.125
    raw = _stage_b_raw(profile, TRUTH, settings, ((None, PD, 2.0),))
    raw |= _stage_b_raw(profile, replace(TRUTH, prefill_contention=1.4), settings,
                        (("prefill_high", PD, rate, settings.prefill_mix),))
    serving = fit_in_situ(profile, raw, settings).serving
    assert serving.prefill_contention == pytest.approx(1.4, rel=0.05)
    assert serving.contention == pytest.approx(2.0, rel=0.1)
    assert serving.in_situ["prefill_high"] == {"mix": "long-prompt", "load_rate": rate}
    calibration, busy = serving.in_situ["prefill_check"]
    assert calibration["factor"] == pytest.approx(2.0, rel=0.05) and busy["factor"] == pytest.approx(1.4, rel=0.05)
    assert busy["simulated_step_s"] == pytest.approx(busy["measured_step_s"], rel=0.02)
    assert calibration["simulated_step_s"] < 0.85 * calibration["measured_step_s"]

    del raw["prefill_high"]
    older = fit_in_situ(profile, raw, settings).serving
    assert older.prefill_contention == pytest.approx(2.0, rel=0.05)
    assert older.in_situ["prefill_high"] is None and len(older.in_situ["prefill_check"]) == 1


def test_a_lone_pods_prefill_part_is_fitted_on_its_prefill_run(profile):
    """A one-pod cluster whose decode rows step at 0.8x their profiled cost and its prefill chunks at
    1.5x: stage B's calibration run (`chat`) and its `long-prompt` run give both back within 5%,
    and both runs' mean steps within 3%; one factor fitted on `chat` alone (an older stage B) is
    far from the prefill part's. The file keeps the factor; older files read None (one factor)."""
    from dataclasses import replace

    from cbserve.planner.in_situ import ALONE, PD, InSituSettings, _load_rate, fit_in_situ

    settings = InSituSettings(seconds=8.0, probe_repeats=1)
    truth = replace(TRUTH, alone_contention=0.8, alone_prefill_contention=1.5)
    rate = _load_rate(with_serving(profile, ServingProfile()), settings, ALONE, settings.prefill_busy,
                      mix=settings.prefill_mix)
    raw = _stage_b_raw(profile, truth, settings, ((None, PD, 2.0), ("alone", ALONE, 3.2),
                                                 ("alone_prefill", ALONE, rate, settings.prefill_mix)))
    serving = fit_in_situ(profile, raw, settings).serving
    assert serving.alone_contention == pytest.approx(0.8, rel=0.05)
    assert serving.alone_prefill_contention == pytest.approx(1.5, rel=0.05)
    for run in serving.in_situ["alone_check"]:
        assert run["simulated_step_s"] == pytest.approx(run["measured_step_s"], rel=0.03)
    assert serving.in_situ["alone_prefill"] == {"mix": "long-prompt", "load_rate": rate}
    assert ServingProfile.from_json(serving.to_json()).alone_prefill_contention == serving.alone_prefill_contention
    older_file = TRUTH.to_json() | {"alone_prefill_contention": None}
    assert ServingProfile.from_json(older_file).alone_prefill_contention is None

    del raw["alone_prefill"]
    older = fit_in_situ(profile, raw, settings).serving
    assert older.alone_prefill_contention is None and len(older.in_situ["alone_check"]) == 1
    assert abs(older.alone_contention - 1.5) > 0.3


def test_a_lone_pod_pays_the_decode_rows_cost_and_its_factors_are_fitted_with_it(profile):
    """A lone pod whose engine pays the 1P+1D decode pod's 0.4 ms a decode row on top of 0.8x its
    profiled decode part and 1.5x its prefill part: stage B's four runs give the row cost and both
    lone factors back, both lone runs' mean steps within 3%, and a 48-row decode step of the lone
    pod within 5% of the truth's (one factor from stage B's few-row steps alone puts it short)."""
    from dataclasses import replace

    from cbserve.planner.in_situ import ALONE, PD, InSituSettings, _load_rate, _rows_rate, fit_in_situ
    from engine.telemetry.step_shape import StepShape

    settings = InSituSettings(seconds=8.0, probe_repeats=1)
    truth = replace(TRUTH, contention=1.5, decode_row_s=0.0004, alone_contention=0.8, alone_prefill_contention=1.5,
                    alone_rows=True)
    rows_rate = _rows_rate(with_serving(profile, ServingProfile()), settings, 2.0)
    prefill_rate = _load_rate(with_serving(profile, ServingProfile()), settings, ALONE, settings.prefill_busy,
                              mix=settings.prefill_mix)
    raw = _stage_b_raw(profile, truth, settings, ((None, PD, 2.0), ("decode_high", PD, rows_rate, settings.rows_mix),
                                                 ("alone", ALONE, 3.2),
                                                 ("alone_prefill", ALONE, prefill_rate, settings.prefill_mix)))
    serving = fit_in_situ(profile, raw, settings).serving
    assert serving.alone_rows and serving.decode_row_s == pytest.approx(0.0004, rel=0.1)
    assert serving.alone_contention == pytest.approx(0.8, rel=0.05)
    assert serving.alone_prefill_contention == pytest.approx(1.5, rel=0.05)
    for run in serving.in_situ["alone_check"]:
        assert run["simulated_step_s"] == pytest.approx(run["measured_step_s"], rel=0.03)
    big = StepShape(48, 48 * 300, 300, 300, num_sampled=48)
    lone = with_serving(profile, serving).pod_costs()["alone"]
    true_step = with_serving(profile, truth).pod_costs()["alone"].seconds(big)
    assert lone.seconds(big) == pytest.approx(true_step, rel=0.05)
    assert replace(lone, row_s=0.0).seconds(big) < 0.8 * true_step
    assert ServingProfile.from_json(serving.to_json()).alone_rows


def test_no_row_cost_where_the_decode_factor_does_not_grow_with_the_batch(profile):
    """Decode pods at one factor whatever their batch: the two runs' solve finds no row cost
    worth modelling (at most a hundredth of a millisecond, or none) and the factor as before."""
    from dataclasses import replace

    from cbserve.planner.in_situ import PD, InSituSettings, _rows_rate, fit_in_situ

    settings = InSituSettings(seconds=8.0, probe_repeats=1)
    truth = replace(TRUTH, contention=1.5)
    rate = _rows_rate(with_serving(profile, ServingProfile()), settings, 2.0)
    raw = _stage_b_raw(profile, truth, settings, ((None, PD, 2.0), ("decode_high", PD, rate, settings.rows_mix)))
    serving = fit_in_situ(profile, raw, settings).serving
    assert serving.decode_row_s < 1e-5
    assert serving.contention == pytest.approx(1.5, rel=0.03)


def test_a_decode_row_costs_its_share_in_every_step_that_has_it(tmp_path):
    """`decode_row_s` is paid per decode row, times the step's scale, by decode pods and by split
    colocated pods' decode part, and by a lone pod whose factors were fitted with it (`alone_rows`);
    prefill pods and one-factor pods do not pay it; the file keeps it and an older file reads 0."""
    import json
    from dataclasses import replace

    from cbserve.planner.profile import load_profile
    from engine.telemetry.step_shape import StepShape

    from tests.planner.conftest import make_profile

    serving = ServingProfile(contention=1.5, prefill_contention=0.6, colocated_split=True, decode_row_s=0.001)
    path = tmp_path / "new.json"
    make_profile(serving).save(path)
    data = json.loads(path.read_text())
    assert data["serving"]["decode_row_s"] == 0.001
    del data["serving"]["decode_row_s"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_profile(tmp_path / "old.json").serving.decode_row_s == 0.0
    profile = load_profile(path)
    mixed = StepShape(4, 400, 100, 100, prefill_chunks=((200, 0),), num_sampled=5)
    model, costs = profile.cost_model, profile.pod_costs()
    whole, decode = model.seconds(mixed), model.seconds(mixed.decode_part())
    assert costs["decode"].seconds(mixed.decode_part(), scale=2.0) == pytest.approx(2 * (1.5 * decode + 0.004))
    assert costs["colocated"].seconds(mixed) == pytest.approx(1.5 * decode + 0.004 + 0.6 * (whole - decode))
    assert costs["prefill"].seconds(StepShape(0, 0, prefill_chunks=((200, 0),), num_sampled=1)) == pytest.approx(
        0.6 * model.seconds(StepShape(0, 0, prefill_chunks=((200, 0),), num_sampled=1)))
    assert costs["alone"].row_s == 0.0        # a lone pod's factors were not fitted with the row cost
    assert load_profile(tmp_path / "old.json").serving.alone_rows is False
    lone = with_serving(profile, replace(serving, alone_rows=True)).pod_costs(step_scale=2.0)["alone"]
    assert lone.row_s == pytest.approx(0.002)
    assert profile.pod_costs(step_scale=2.0)["decode"].row_s == pytest.approx(0.002)
