"""bench/gpu_check.sh's parts on the CPU: the script parses, decode_step.py runs on `tiny` and
prints its JSON, a shape checkpoint loads in both cbserve and transformers, and the table reads
every section's output (including failed and skipped ones). No timings are asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check_table as table
from bench import shapes
from engine import presets

ROOT = Path(__file__).resolve().parents[2]


def test_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], check=True)


SECTIONS = ROOT / "bench" / "gpu_check_sections.txt"
KILL_GRACE = 10      # gpu_check.sh: timeout's -k


def _plans() -> dict[str, dict]:
    """bench/gpu_check_sections.txt, as the script reads it (`IFS='|' read -r ...`)."""
    plans: dict[str, dict] = {}
    for line in SECTIONS.read_text().splitlines():
        fields = line.split("|", 7)
        if fields[0] == "budget":
            _, plan, budget, reserve = fields
            plans.setdefault(plan, {"sections": []}).update(budget=int(budget), reserve=int(reserve))
        elif fields[0] == "section":
            _, plan, sid, cap, minimum, artifact, name, command = fields
            plans.setdefault(plan, {"sections": []})["sections"].append(
                dict(id=sid, cap=int(cap), min=int(minimum), artifact=artifact, name=name, command=command))
        else:
            assert not line.strip() or line.startswith("#"), line
    return plans


@pytest.mark.parametrize("plan", ["full", "fp8", "smoke"])
def test_every_plan_fits_its_budget(plan):
    """The caps add up to at most the budget less the reserve kept for the table and the copies:
    each section gets its whole cap even if every one before it runs to its own."""
    p = _plans()[plan]
    caps = sum(s["cap"] for s in p["sections"])
    assert caps <= p["budget"] - p["reserve"], f"{plan}: caps {caps} s > budget {p['budget']} - reserve {p['reserve']}"
    ids = [s["id"] for s in p["sections"]]
    assert len(ids) == len(set(ids))
    for s in p["sections"]:
        assert 0 < s["min"] <= s["cap"] and "|" not in s["command"], s
        assert table._number(s["id"]), f"{s['id']}: the table has no row kind for it"
        assert s["artifact"] == "-" or s["artifact"].endswith((".log", ".json")), s


def test_the_full_plan_runs_the_graph_test_first_and_goodput_last():
    sections = _plans()["full"]["sections"]
    ids = [s["id"] for s in sections]
    assert ids[0] == "preflight" and "test_cuda_graphs_gpu.py" in sections[1]["command"]
    assert ids[2].startswith("decode-1b") and ids[-1].startswith("goodput")
    kinds = [table._number(sid) for sid in ids]
    assert "fp8" in " ".join(ids) and {"1", "2", "3", "4", "5"} <= set(kinds)
    # The one GPU pod-path goodput section keeps to one config and one rate.
    goodput = sections[-1]["command"]
    assert goodput.count("--rates") == 1 and len(goodput.split("--rates")[1].split("--")[0].split()) == 1


def test_the_script_reads_the_plan_file_and_interrupts_with_sigint():
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert "bench/gpu_check_sections.txt" in script and 'timeout -s INT -k "$KILL_GRACE"' in script
    assert f"KILL_GRACE={KILL_GRACE} " in script and "TRITON_CACHE_DIR" in script
    assert "-v -rA --continue-on-collection-errors" in script


def test_decode_step_tiny_on_cpu_prints_its_json(tmp_path):
    proc = subprocess.run(
        [sys.executable, "bench/decode_step.py", "--shape", "tiny", "--device", "cpu", "--batch", "1,2",
         "--context", "32", "--steps", "4", "--warmup", "2", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["shape"] == "tiny" and result["device"] == "cpu"
    assert result["copy_bandwidth_gb_s"] > 0 and result["weight_bytes"] > 0
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["context"] == 32
        for key in ("median_ms", "p10_ms", "p90_ms", "window_mean_ms", "bound_ms", "ratio", "kv_bytes",
                    "output_tok_s"):
            assert row[key] > 0, key
        assert row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
        assert row["steps_not_pure_decode"] == 0
    # The table reads it back.
    (tmp_path / "decode-tiny.log").write_text(proc.stderr + proc.stdout)
    rows = table.section_rows({"id": "decode-tiny", "name": "decode step", "status": "ok", "seconds": "9",
                               "log": tmp_path / "decode-tiny.log", "artifact": tmp_path / "decode-tiny.log"})
    assert [r[0] for r in rows] == ["tiny batch 1 ctx 32", "tiny batch 2 ctx 32", "tiny setup"]


def test_decode_step_fp8_on_cpu_reports_fp8_weights_and_kv(tmp_path):
    """The FP8 sections' dry path: e4m3 weights (the reference path on CPU) and an e4m3 KV cache."""
    from bench.decode_step import weight_bytes
    from engine.model_config import ModelConfig
    from engine.presets import resolve_model_dir

    proc = subprocess.run(
        [sys.executable, "bench/decode_step.py", "--shape", "tiny", "--device", "cpu", "--batch", "1",
         "--context", "32", "--steps", "3", "--warmup", "2", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
         "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["quantization"], result["kv_cache_dtype"]) == ("fp8", "float8_e4m3fn")
    import torch
    plain = weight_bytes(ModelConfig.from_dir(resolve_model_dir("tiny")), torch.float32)
    assert 0 < result["weight_bytes"] < plain and 0 < result["weight_memory_bytes"]
    assert result["rows"][0]["kv_bytes"] > 0 and result["rows"][0]["median_ms"] > 0
    (tmp_path / "decode-tiny-fp8.log").write_text(proc.stdout)
    rows = table.section_rows({"id": "decode-tiny-fp8", "name": "decode step (fp8)", "status": "ok", "seconds": "9",
                               "log": tmp_path / "decode-tiny-fp8.log", "artifact": tmp_path / "decode-tiny-fp8.log"})
    assert [r[0] for r in rows] == ["tiny fp8 kv-fp8 batch 1 ctx 32", "tiny fp8 kv-fp8 setup"]
    assert "in memory" in rows[1][1]


def test_shape_checkpoint_loads_in_cbserve_and_transformers(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from engine.engine import Engine, EngineConfig
    from engine.presets import PRESETS
    from engine.sampling.params import SamplingParams

    monkeypatch.setenv("CBSERVE_CACHE_DIR", str(tmp_path))
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=600, max_position_embeddings=256, seed=5)
    monkeypatch.setitem(PRESETS, "test-shape", shape)   # removed again after the test
    path = shapes.build_checkpoint("test-shape", shape)
    assert path == tmp_path / "models" / f"test-shape-v{presets.FORMAT_VERSION}"
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert shapes.build_checkpoint("test-shape", shape) == path          # cached: not written again
    prompt = [5, 9, 200, 7]
    engine = Engine(EngineConfig(model=str(path), dtype="float32"))
    ours = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours.output_token_ids == theirs


def test_engine_config_fields_splits_known_from_unknown():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Config:
        device: str = "cpu"

    assert shapes.engine_config_fields(Config, device="cuda", enforce_eager=True) == (
        {"device": "cuda"}, ["enforce_eager"])


PYTEST_OUT = "....F\n=== short test summary info ===\nFAILED tests/x.py::t - boom\n1 failed, 20 passed, 1 skipped, 300 deselected in 41.2s\n"
KERNELS_OUT = """device=cuda dtype=bf16 kv_heads=8 group=4 head_dim=128 block_size=16
attention decode 64 x 4096 [auto]  triton     0.512 ms   3440.0 GB/s | ref     1.900 ms    927.0 GB/s  max_err 1.95e-03
attention mixed 4x1024 chunks + 60 decodes [auto] triton     1.000 ms    780.0 GB/s | ref     9.000 ms     86.7 GB/s  max_err 3.9e-03
rms_norm                           triton     0.030 ms   4400.0 GB/s | ref     0.100 ms   1342.0 GB/s  max_err 0.00e+00
attention decode 8 x 256           triton                           | ref     0.300 ms      1.2 GB/s  
"""


@pytest.mark.parametrize("text, counts", [
    (PYTEST_OUT, {"failed": 1, "passed": 20, "skipped": 1, "deselected": 300}),
    ("===== 22 passed, 3 deselected in 9.1s =====", {"passed": 22, "deselected": 3}),
    ("ERROR collecting\n1 error in 0.5s", {"error": 1}),
    ("Traceback (most recent call last):", {}),
])
def test_pytest_counts(text, counts):
    assert table.pytest_counts(text) == counts


def test_kernel_rows_read_triton_and_reference_only_lines():
    rows = table.kernel_rows(KERNELS_OUT)
    assert [r["name"] for r in rows] == ["attention decode 64 x 4096 [auto]",
                                         "attention mixed 4x1024 chunks + 60 decodes [auto]", "rms_norm",
                                         "attention decode 8 x 256"]
    assert rows[0]["gbs"] == 3440.0 and rows[0]["ref_gbs"] == 927.0 and rows[0]["max_err"] == "1.95e-03"
    assert rows[3]["gbs"] is None and rows[3]["ref_ms"] == 0.3


def test_table_has_a_row_for_every_section_whatever_happened(tmp_path):
    decode = {"shape": "1b", "copy_bandwidth_gb_s": 4300.0, "weight_bytes": 2_470_000_000, "checkpoint_s": 5.0,
              "engine_load_s": 9.0, "unsupported_options": [],
              "rows": [{"batch": 1, "context": 256, "median_ms": 4.0, "p10_ms": 3.9, "p90_ms": 4.2,
                        "window_mean_ms": 3.8, "bound_ms": 0.58, "ratio": 6.9, "steps_not_pure_decode": 0}]}
    throughput = {"model": "1b", "num_prompts": 512, "cbserve_output_tok_s": 9000.0, "kv_cache_bytes": 100 << 30,
                  "hf_output_tok_s": 1700.0, "hf_num_prompts": 512, "hf_batch_size": 128, "speedup": 5.29}
    goodput = {"rows": [{"mix": "chat", "config": "pd-goodput", "rate": 4.0, "goodput_rps": 3.9,
                         "slo_attainment": 0.98, "p95_ttft_s": 0.05, "p95_tpot_s": 0.01, "error_rate": 0.0,
                         "offered_rps": 4.0}]}
    files = {"tests.log": PYTEST_OUT, "kernels.log": KERNELS_OUT,
             "decode-1b.log": "# batch 1: median\n" + json.dumps(decode) + "\n",
             "decode-8b.log": "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory\n",
             "throughput-1b.log": json.dumps(throughput) + "\n", "goodput-pd-goodput.json": json.dumps(goodput),
             "goodput-pd.log": "", "throughput-8b.log": "out of time: 20 s left of the 460 s budget, needs 60 s"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    sections = [("tests", "gpu tests", "failed rc=1", "tests.log", ""),
                ("kernels", "kernel bandwidth", "ok", "kernels.log", ""),
                ("decode-1b", "decode step", "ok", "decode-1b.log", "decode-1b.log"),
                ("decode-8b", "decode step", "failed rc=1", "decode-8b.log", "decode-8b.log"),
                ("throughput-1b", "offline throughput", "ok", "throughput-1b.log", "throughput-1b.log"),
                ("goodput-pd", "goodput (1P+1D)", "ok", "goodput-pd.log", "goodput-pd-goodput.json"),
                ("goodput-colocated", "goodput (colocated-2)", "timeout 90s", "goodput-pd.log",
                 "goodput-colocated-2.json"),
                ("throughput-8b", "offline throughput", "skipped", "throughput-8b.log", "")]
    (tmp_path / "sections.tsv").write_text("".join(f"{a}\t{b}\t{c}\t7\t{d}\t{e}\n" for a, b, c, d, e in sections))
    md = table.build_table(tmp_path)
    body = md.splitlines()[2:]
    assert [line.split(" | ")[0] for line in body] == ["| 1"] * 2 + ["| 2"] * 4 + ["| 3"] * 3 + ["| 4"] * 3 + ["| 5"] * 2
    assert "1 failed" in md and "20 passed" in md and "FAILED tests/x.py::t - boom" in md
    assert "80% of copy" in md and "before 3.44 TB/s" in md and "before 0.78 TB/s" in md
    assert "bound 0.58 ms, x6.9; before 4.45–11.6 ms" in md
    assert "CUDA out of memory" in md
    assert "x5.29" in md and "102,400 MB" in md and "before cbserve 6,923–8,120 tok/s, transformers 1,682" in md
    assert "goodput 3.90 req/s" in md and "timeout 90s" in md
    assert "skipped (out of time" in md
