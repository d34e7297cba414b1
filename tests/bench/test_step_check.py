"""`CBSERVE_STEP_TRACE`: an engine writes every step it takes; `bench/step_check.py` holds them against a profile."""

from __future__ import annotations

import json

import pytest
import torch

from bench import step_check
from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from engine.telemetry.step_shape import StepShape
from engine.telemetry.step_stats import STEP_TRACE_ENV
from tests.planner.conftest import make_profile


def test_an_engine_traces_every_step_and_step_check_reads_the_trace(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(STEP_TRACE_ENV, str(tmp_path / "steps"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model="tiny", role="colocated", max_model_len=256,
                                 cache=CacheConfig(block_size=16, num_blocks=32),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4,
                                                           max_model_len=256)))
    shapes = []
    original = engine.step_stats.record

    def record(out, seconds):
        shapes.append(StepShape.of(out))
        original(out, seconds)

    engine.step_stats.record = record
    tracer = engine.step_stats.trace
    try:
        engine.generate([[5 + i] * (20 + 9 * i) for i in range(3)],
                        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finally:
        engine.close()
        torch.set_num_threads(threads)
    assert tracer._file.closed                         # Engine.close closes the trace
    [trace] = (tmp_path / "steps").glob("steps-colocated-*.jsonl")
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    # one line per recorded step, after the warm-up's: [end, seconds, CPU so far, shape]
    run = lines[-len(shapes):]
    assert [StepShape.from_json(line[3]) for line in run] == shapes
    assert any(s.prefill_chunks and s.num_decodes for s in shapes)          # a mixed step among them
    assert all(line[1] > 0 for line in run) and all(b[0] >= a[0] and b[2] >= a[2] for a, b in zip(run, run[1:]))

    # the comparison reads back what the trace holds, against the profile's colocated step costs
    profile = make_profile()
    profile.save(tmp_path / "profile.json")
    costs = profile.pod_costs()["colocated"]
    step_check.main(["--profile", str(tmp_path / "profile.json"), "--steps", str(tmp_path / "steps"),
                     "--gap", "1000", "--json", str(tmp_path / "check.json")])
    printed = capsys.readouterr().out
    assert "decode" in printed and "mixed" in printed
    check = json.loads((tmp_path / "check.json").read_text())[trace.name]
    steps = sum(v[0] for v in check["kinds"].values())
    assert steps == len(lines) - 1
    profiled = sum(v[3] for v in check["kinds"].values())
    expected = sum(costs.seconds(StepShape.from_json(line[3])) for line in lines[1:])
    assert abs(profiled - expected) < 1e-9 * max(1.0, expected)
    wall = sum(v[1] for v in check["kinds"].values())
    assert abs(wall - sum(line[1] for line in lines[1:])) < 1e-6


def test_the_run_is_the_longest_stretch_without_a_pause():
    # [end, seconds, cpu, shape]: a warm-up, a 5 s pause, the run, a 2 s pause, one stray step
    lines = [[0.1, 0.1, 0, []], [0.2, 0.1, 0, []], [5.3, 0.1, 0, []], [5.4, 0.1, 0, []], [5.5, 0.1, 0, []],
             [7.6, 0.1, 0, []]]
    assert step_check.run_stretch(lines, 1.0) == lines[2:5]
    assert step_check.run_stretch(lines, 10.0) == lines


def test_shares_hold_each_pods_step_wall_over_cpu_against_max_min_and_c_over_n(tmp_path, capsys):
    # a colocated-2 row at its knee (session 15's): engines 95% and 97% busy, serving 0.53 of 2 cores
    row = {"config": "colocated-2", "rate": 10.0, "elapsed_s": 31.0,
           "cpu_s": {"client": 6.28, "router": 6.06, "colocated-0": 23.53, "colocated-1": 24.69},
           "cpu_threads_s": {"router": {"server": 6.03, "engine": 0.0},
                             "colocated-0": {"server": 1.46, "engine": 21.52},
                             "colocated-1": {"server": 1.47, "engine": 22.69}},
           "step_s": {"colocated-0": 29.42, "colocated-1": 30.12}}
    got = step_check.shares(row, 2)
    serving = (6.28 + 6.06 + 23.53 + 24.69 - 21.52 - 22.69) / 31.0
    assert got["colocated-0"]["serving_cores"] == pytest.approx(serving)
    assert got["colocated-0"]["measured"] == pytest.approx(29.42 / 21.52)
    assert got["colocated-0"]["max_min"] == pytest.approx(2 / (2 - serving))    # both engines split the rest
    assert got["colocated-0"]["c_over_n"] == pytest.approx((1 + serving + 30.12 / 31.0) / 2)
    path = tmp_path / "goodput.json"
    path.write_text(json.dumps({"meta": {"cpus": "0,1", "cpu_count": 16}, "rows": [row]}))
    step_check.main(["--shares", str(path)])
    assert "max-min 1.36" in capsys.readouterr().out
    step_check.main(["--shares", str(path), str(path)])     # several runs: medians per kind of pod
    summary = capsys.readouterr().out.split("medians:")[1]
    assert "colocated-2    colocated     4 pods" in summary and "all" in summary
