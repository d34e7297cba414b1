"""bench/plan_check.py: the measured-contention prediction recovers a run's known contention."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from bench.plan_check import FATES, by_request, check, over_time
from cbserve.goodput.stats import RequestResult, Slo
from cbserve.goodput.workloads import MIXES
from cbserve.planner.simulate import sim_model, sweep_runs
from tests.planner.conftest import make_profile

SLO = Slo(2.0, 0.2)
TRUE_CONTENTION = {"prefill": 3.0, "decode": 2.0}     # the profile says 1.1 and 1.2


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    profile = make_profile()
    directory = tmp_path_factory.mktemp("plan_check")
    profile.save(directory / "profile.json")
    # "Measured": the same simulator on a machine twice to three times as loaded as the profile's.
    runs = sweep_runs(sim_model(profile), "pd-goodput", MIXES["chat"], [2.0], 6.0, 0, SLO, warmup=4,
                      stop_below_attainment=0.0, contention={2.0: TRUE_CONTENTION})
    meta = {"model": "tiny", "slo_ttft_ms": 2000.0, "slo_tpot_ms": 200.0, "duration_s": 6.0, "seed": 0,
            "prefix_caching": "auto"}
    # As `bench/goodput.py --save-requests` keeps them: each row with its requests.
    rows = [dict(run.row, mix="chat", requests=[asdict(r) for r in run.results]) for run in runs]
    (directory / "measured.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    return rows[0], check(str(directory / "profile.json"), str(directory / "measured.json"), window_s=2.0,
                           per_request=True)


def test_measured_contention_is_recovered(checked):
    measured, (row,) = checked
    for role, factor in TRUE_CONTENTION.items():
        assert row["contention"][role] == pytest.approx(factor, rel=0.1)
    for role, seconds in measured["mean_step_s"].items():
        assert row["predicted_measured_contention"]["mean_step_s"][role] == pytest.approx(seconds, rel=0.05)
    # The profile's own contention is lower: its steps are shorter than the measured run's.
    assert all(row["predicted"]["mean_step_s"][r] < s for r, s in measured["mean_step_s"].items())


def test_errors_are_relative_to_the_measurement(checked):
    measured, (row,) = checked
    assert row["measured"]["goodput_rps"] == measured["goodput_rps"] > 0
    assert row["goodput_error"] == pytest.approx(row["predicted"]["goodput_rps"] / measured["goodput_rps"] - 1)
    assert row["goodput_error_measured_contention"] == pytest.approx(
        row["predicted_measured_contention"]["goodput_rps"] / measured["goodput_rps"] - 1)


def test_repeats_are_compared_by_their_medians():
    from bench.plan_check import medians

    def row(rate, measured, predicted):
        return {"mix": "chat", "config": "1P1D", "rate": rate,
                "measured": {"goodput_rps": measured}, "predicted": {"goodput_rps": predicted},
                "predicted_measured_contention": {"goodput_rps": predicted * 1.1},
                "goodput_error": predicted / measured - 1, "goodput_error_measured_contention": predicted * 1.1 / measured - 1}

    rows = [row(10, 9.0, 7.0), row(10, 6.0, 9.0), row(10, 8.0, 8.5), row(12, 4.0, 5.0)]
    by_rate = {r["rate"]: r for r in medians(rows)}
    ten = by_rate[10]
    assert ten["runs"] == 3 and ten["measured"] == [9.0, 6.0, 8.0] and ten["predicted"] == [7.0, 9.0, 8.5]
    assert (ten["measured_median"], ten["predicted_median"]) == (8.0, 8.5)
    assert ten["goodput_error"] == pytest.approx(8.5 / 8.0 - 1)
    assert ten["goodput_error_measured_contention"] == pytest.approx(8.5 * 1.1 / 8.0 - 1)
    assert by_rate[12]["runs"] == 1 and by_rate[12]["goodput_error"] == pytest.approx(0.25)
    # Each run against the mean of its row's other runs: 9 vs 7, 6 vs 8.5, 8 vs 7.5; a lone run has none.
    assert ten["others_errors"] == pytest.approx([7 / 9 - 1, 8.5 / 6 - 1, 7.5 / 8 - 1])
    assert by_rate[12]["others_errors"] == [None]
    from bench.plan_check import summary

    counts = summary(rows, medians(rows))
    assert counts["runs"] == (1, 4)                   # only 8.5 against 8 is within 15%
    assert counts["medians"] == (1, 2) and counts["runs_against_their_other_runs"] == (1, 3)


def test_each_repeat_is_its_own_cluster(checked, tmp_path):
    """A `bench/goodput.py --repeats` file: each pass is simulated as the fresh cluster it ran on."""
    measured, _ = checked
    profile = make_profile()
    profile.save(tmp_path / "profile.json")
    meta = {"model": "tiny", "slo_ttft_ms": 2000.0, "slo_tpot_ms": 200.0, "duration_s": 6.0, "seed": 0,
            "prefix_caching": "auto", "repeats": 2}
    rows = [dict(measured, repeat=i) for i in (0, 1)]
    (tmp_path / "measured.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    first, second = check(str(tmp_path / "profile.json"), str(tmp_path / "measured.json"))
    assert (first["repeat"], second["repeat"], first["rate"], second["rate"]) == (0, 1, 2.0, 2.0)
    assert first["predicted"] == second["predicted"]       # the same requests on a fresh cluster each


def test_a_run_is_compared_window_by_window(checked):
    measured, (row,) = checked
    windows = row["over_time"]
    results = [RequestResult(**r) for r in measured["requests"]]
    assert [w["start_s"] for w in windows] == sorted(w["start_s"] for w in windows)
    assert sum(w["requests"] for w in windows) == len(results)
    assert sum(w["met"][0] for w in windows) == sum(SLO.met(r) for r in results)
    # The measured pods stepped two to three times slower: every window's TPOT is longer there.
    assert all(w["tpot_s"][0] > w["tpot_s"][1] for w in windows if w["tpot_s"][0] is not None)


def test_windows_count_arrivals_met_and_refused_requests_measured_and_predicted():
    slo = Slo(1.0, 0.1)

    def result(index, at, outcome="ok", ttft=0.2, tpot=0.05):
        if outcome != "ok":
            return RequestResult(index, at, at, outcome)
        return RequestResult(index, at, at, "ok", first_token_s=at + ttft, last_token_s=at + ttft + 10 * tpot,
                             num_output_tokens=11)

    measured = [result(0, 0.5), result(1, 1.2, "rejected"), result(2, 1.8, ttft=1.5), result(3, 2.1, tpot=0.08)]
    predicted = [result(0, 0.5, ttft=0.1), result(1, 1.2), result(2, 1.8), result(3, 2.1, tpot=0.04)]
    windows = over_time([asdict(r) for r in measured], predicted, slo, 1.0)
    assert [(w["start_s"], w["requests"], w["met"], w["refused"]) for w in windows] == [
        (0.0, 1, [1, 1], [0, 0]), (1.0, 2, [0, 2], [1, 0]), (2.0, 1, [1, 1], [0, 0])]
    # Means over the requests served in both runs only (request 1 was refused in the measured one).
    assert windows[0]["ttft_s"] == pytest.approx([0.2, 0.1])
    assert windows[1]["ttft_s"] == pytest.approx([1.5, 0.2])
    assert windows[2]["tpot_s"] == pytest.approx([0.08, 0.04])


def test_a_run_is_compared_request_by_request(checked):
    measured, (row,) = checked
    b = row["by_request"]
    assert sum(sum(cols.values()) for cols in b["fates"].values()) == len(measured["requests"])
    assert sum(b["fates"]["met"].values()) == sum(SLO.met(RequestResult(**r)) for r in measured["requests"])
    # Against the simulation at the run's recovered contention, the "measured" (simulated) run
    # repeats: nearly every request has the same fate, and the same latencies.
    same = sum(b["fates"][f][f] for f in FATES)
    assert same >= 0.9 * len(measured["requests"])
    assert b["served_in_both"] > 0 and abs(b["ttft_diff_s"]) < 0.05 and abs(b["tpot_diff_s"]) < 0.01


def test_requests_are_crossed_by_fate_measured_and_predicted():
    slo = Slo(1.0, 0.1)

    def result(index, outcome="ok", ttft=0.2, tpot=0.05):
        if outcome != "ok":
            return RequestResult(index, 0.0, 0.0, outcome)
        return RequestResult(index, 0.0, 0.0, "ok", first_token_s=ttft, last_token_s=ttft + 10 * tpot,
                             num_output_tokens=11)

    measured = [result(0), result(1, "rejected"), result(2, ttft=1.5), result(3, tpot=0.08), result(4, "error"),
                result(5),
                result(6, "cancelled")]
    predicted = [result(0, ttft=0.1), result(1), result(2), result(3, "rejected"), result(4),
                 result(6, "cancelled")]   # 5: not simulated
    b = by_request([asdict(r) for r in measured], predicted, slo)
    assert {(m, p): n for m, cols in b["fates"].items() for p, n in cols.items() if n} == {
        ("met", "met"): 1, ("refused", "met"): 1, ("missed", "met"): 1, ("met", "refused"): 1, ("failed", "met"): 1,
        ("cancelled", "cancelled"): 1}
    # Differences over the requests served in both only: 0 (+0.1 s) and 2 (+1.3 s).
    assert b["served_in_both"] == 2
    assert b["ttft_diff_s"] == pytest.approx(0.7) and b["tpot_diff_s"] == pytest.approx(0.0)
