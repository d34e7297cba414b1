"""`cbserve plan` and `cbserve profile` from the command line: rows with the benchmark's fields, a
search that writes a values file, a plot and its JSON, clear errors for a bad profile, trace or
model, and a profile refused (exit 3, nothing written but the rejected measurements) when its
held-out error is above the gate."""

from __future__ import annotations

import json

import pytest
import yaml

from cbserve.cli import main
from cbserve.goodput.stats import RunSummary

ROW_FIELDS = set(RunSummary.__dataclass_fields__) | {"mix", "config", "sample_errors", "mean_step_s", "latency_calibration"}


def test_rows_have_the_benchmarks_fields(profile_file, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["plan", "--profile", str(profile_file), "--mix", "chat", "fixed-256-64", "--rates", "1", "2",
                 "--duration", "5", "--configs", "colocated-2", "1P1D", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["prediction"] is True and data["meta"]["model"] == "tiny"
    assert len(data["rows"]) == 8 and all(set(r) == ROW_FIELDS for r in data["rows"])
    assert {(r["mix"], r["config"]) for r in data["rows"]} == {(m, c) for m in ("chat", "fixed-256-64")
                                                              for c in ("colocated-2", "1P1D")}
    assert "goodput" in capsys.readouterr().out            # the benchmark's table


def test_search_recommends_and_writes_values_plot_and_json(tmp_path, capsys):
    from cbserve.planner.profile import ServingProfile
    from tests.planner.conftest import make_profile

    # Slow steps keep capacities (and so the simulated requests) few: a quick test.
    profile_file = tmp_path / "slow.json"
    make_profile(ServingProfile(contention=8.0, prefill_contention=8.0, step_gap_s=0.002)).save(profile_file)
    values, plot, out = tmp_path / "values.yaml", tmp_path / "plan.png", tmp_path / "plan.json"
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_tokens": 60 + 40 * i, "output_tokens": 20 + 5 * i})
                               for i in range(6)) + "\n")
    assert main(["plan", "--profile", str(profile_file), "--trace", str(trace), "--search", "--search-duration", "6",
                 "--configs", "colocated-1", "1P1D", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100",
                 "--jobs", "1", "--tolerance", "0.2", "--values-out", str(values), "--plot", str(plot), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "recommendation:" in printed
    search = json.loads(out.read_text())["search"]
    chosen = search["recommendation"]["config"]
    assert chosen in ("colocated-1", "1P1D") and f"recommendation: {chosen}" in printed
    assert all(c["capacity_rps"] > 0 for c in search["capacities"])
    assert all(c["band_rps"][0] <= c["capacity_rps"] <= c["band_rps"][1] for c in search["capacities"])
    # The HPA targets are set at --headroom (0.8) x the chosen one's band's low end.
    band = next(c["band_rps"] for c in search["capacities"] if c["config"] == chosen)
    assert search["operating_point"]["rate"] == pytest.approx(0.8 * band[0])
    planned = yaml.safe_load(values.read_text())
    assert planned["slo"] == {"ttftMs": 1000, "tpotMs": 100} and planned["decode"]["autoscaling"]["enabled"]
    assert values.read_text().startswith("# cbserve plan: ")
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_a_target_rates_choice_gets_its_band_and_hpa_targets_at_its_low_end(tmp_path):
    from cbserve.planner.profile import ServingProfile
    from tests.planner.conftest import make_profile

    profile_file = tmp_path / "slow.json"
    make_profile(ServingProfile(contention=8.0, prefill_contention=8.0, step_gap_s=0.002)).save(profile_file)
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_tokens": 60 + 40 * i, "output_tokens": 20 + 5 * i})
                               for i in range(6)) + "\n")
    out = tmp_path / "plan.json"
    # No configuration reaches 10^4 req/s: the one with the most capacity is chosen, finalist or not.
    assert main(["plan", "--profile", str(profile_file), "--trace", str(trace), "--search", "--search-duration", "6",
                 "--configs", "colocated-1", "colocated-2", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100",
                 "--target-rate", "10000", "--jobs", "1", "--tolerance", "0.2", "--json", str(out)]) == 0
    search = json.loads(out.read_text())["search"]
    chosen = next(c for c in search["capacities"] if c["config"] == search["recommendation"]["config"])
    assert chosen["capacity_rps"] == max(c["capacity_rps"] for c in search["capacities"])
    assert chosen["band_rps"] is not None and chosen["band_rps"][0] <= chosen["capacity_rps"]
    assert search["operating_point"]["rate"] == pytest.approx(0.8 * chosen["band_rps"][0])


@pytest.mark.parametrize("argv, message", [
    (["--profile", "{missing}"], "cannot read the profile"),
    (["--profile", "{bad}"], "not a cbserve profile"),
    (["--profile", "{good}", "--model", "small"], "the profile {good} is of tiny"),
    (["--profile", "{good}", "--trace", "{trace}"], "t.jsonl:1: output_tokens is required"),
    (["--profile", "{good}", "--mix", "nope"], "unknown mix 'nope'"),
    (["--profile", "{good}", "--mix", "chat", "--trace", "{trace}"], "give --mix or --trace, not both"),
    (["--profile", "{good}", "--configs", "3X"], "unknown configuration '3X'"),
])
def test_bad_inputs_are_clear_errors(profile_file, tmp_path, capsys, argv, message):
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    (tmp_path / "t.jsonl").write_text('{"prompt_tokens": 10}\n')
    names = {"missing": tmp_path / "nope.json", "bad": tmp_path / "bad.json", "good": profile_file,
             "trace": tmp_path / "t.jsonl"}
    argv = [a.format(**names) for a in argv]
    with pytest.raises(SystemExit) if "--configs" in argv else _nothing():
        assert main(["plan", *argv, "--rates", "1", "--duration", "2"]) == 2
    assert message.format(**names) in capsys.readouterr().err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_profile_refuses_a_model_above_the_gate_and_writes_one_below(monkeypatch, tmp_path, capsys):
    """Stage A's measurements are replaced (the real grid takes minutes): noisy ones fail the gate."""
    import random

    from cbserve.planner import profiler
    from cbserve.planner.step_grid import GridPoint, Measurement
    from engine.telemetry.step_shape import StepShape

    def fake(noise):
        def measure(engine, settings, log=print, timer=None, journal=None):
            rng = random.Random(0)
            points = []
            for i in range(60):
                b, c, n = rng.randint(1, 32), rng.randint(32, 1024), rng.randint(16, 256) * (i % 2)
                shape = StepShape(b, b * c, c, c, ((n, 0),) if n else (), b + (1 if n else 0))
                seconds = (0.004 + 1e-4 * (b + n) + 2e-8 * b * c) * (1 + rng.uniform(-noise, noise))
                points.append(Measurement(GridPoint("decode"), shape, (seconds,)))
            return points[:48], points[48:]
        return measure

    out = tmp_path / "p.json"
    monkeypatch.setattr(profiler, "measure", fake(0.4))
    assert main(["profile", "--model", "tiny", "--no-in-situ", "--out", str(out)]) == 3
    assert "profile refused" in capsys.readouterr().err
    assert not out.exists() and (tmp_path / "p.rejected.json").exists()
    monkeypatch.setattr(profiler, "measure", fake(0.0))
    assert main(["profile", "--model", "tiny", "--no-in-situ", "--out", str(out)]) == 0
    from cbserve.planner.profile import load_profile

    written = load_profile(out)
    assert written.held_out_error < 0.01 and written.serving is None
    assert written.engine["num_blocks"] > 0 and written.data["model"]["name"] == "tiny"
    assert written.data["timer"] == "thread_time" and written.data["device"]["threads"] == 1
    # Stage B alone reuses a grid only of the same model and engine flags.
    again = ["profile", "--grid-from", str(out), "--out", str(tmp_path / "b.json")]
    assert main(again + ["--model", "tiny", "--max-num-seqs", "8"]) == 2
    assert "max_num_seqs: 128 there, 8 here" in capsys.readouterr().err
    assert main(again + ["--model", "small"]) == 2
    assert "a profile of tiny, not of small" in capsys.readouterr().err
    assert main(again + ["--model", "tiny", "--no-in-situ"]) == 2
    assert "nothing to do" in capsys.readouterr().err
