"""`cbserve plan`'s values file renders with the real chart: pools, engine knobs and HPA targets land
where the chart reads them, for a colocated and a disaggregated plan."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from helm_chart import render

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from planner.conftest import make_profile  # noqa: E402

from cbserve.goodput.configs import parse_config  # noqa: E402
from cbserve.planner.helm_values import render as render_values  # noqa: E402
from cbserve.planner.helm_values import values  # noqa: E402

LOAD = {"prefill": {"running_requests": 1.2, "prefill_queue_tokens": 3000.0, "kv_cache_usage": 0.1},
        "decode": {"running_requests": 11.3, "prefill_queue_tokens": 0.0, "kv_cache_usage": 0.31},
        "colocated": {"running_requests": 7.6, "prefill_queue_tokens": 200.0, "kv_cache_usage": 0.92}}


def _write(tmp_path, config: str, device: str = "cpu") -> str:
    v = values(fields=parse_config(config), profile=make_profile(device=device), slo_ttft_ms=800, slo_tpot_ms=60.5,
               load=LOAD, max_scale=2.5)
    path = tmp_path / f"{config}.yaml"
    path.write_text(render_values(v, ["planned by a test"]))
    assert path.read_text().startswith("# planned by a test\n") and yaml.safe_load(path.read_text()) == v
    return str(path)


def _hpa_targets(doc: dict) -> dict[str, str]:
    out = {}
    for metric in doc["spec"]["metrics"]:
        target = metric[metric["type"][0].lower() + metric["type"][1:]]
        out[target["metric"]["name"]] = target["target"].get("averageValue") or target["target"].get("value")
    return out


def test_disaggregated_plan_renders_pools_knobs_and_hpa_targets(tmp_path):
    m = render((_write(tmp_path, "2P3D-least-loaded"),))
    prefill, decode = m.get("HorizontalPodAutoscaler", "cbserve-prefill"), m.get("HorizontalPodAutoscaler", "cbserve-decode")
    assert (prefill["spec"]["minReplicas"], prefill["spec"]["maxReplicas"]) == (2, 5)
    assert (decode["spec"]["minReplicas"], decode["spec"]["maxReplicas"]) == (3, 8)
    assert _hpa_targets(prefill)["cbserve_prefill_queue_tokens"] == "3000"
    targets = _hpa_targets(decode)
    assert targets["cbserve_requests_running"] == "12" and targets["cbserve_kv_cache_usage_ratio"] == "310m"
    container = m.get("Deployment", "cbserve-decode")["spec"]["template"]["spec"]["containers"][0]
    args = " ".join(container["args"])
    assert "--max-num-batched-tokens=512" in args and "--max-num-seqs=64" in args and "--num-blocks=2048" in args
    assert "nvidia.com/gpu" not in str(container.get("resources"))       # a CPU profile: no GPUs
    router = " ".join(m.get("Deployment", "cbserve-router")["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--policy=least_loaded" in router and "--slo-tpot-ms=61" in router


def test_colocated_plan_disables_the_prefill_pool(tmp_path):
    m = render((_write(tmp_path, "colocated-3", device="cuda"),))
    assert not m.has("Deployment", "cbserve-prefill")
    decode = m.get("HorizontalPodAutoscaler", "cbserve-decode")
    assert (decode["spec"]["minReplicas"], decode["spec"]["maxReplicas"]) == (3, 8)
    targets = _hpa_targets(decode)
    assert targets["cbserve_requests_running"] == "8" and targets["cbserve_kv_cache_usage_ratio"] == "800m"
    resources = m.get("Deployment", "cbserve-decode")["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1


@pytest.mark.no_helm
def test_values_use_only_keys_the_schema_knows(tmp_path):
    import json

    import jsonschema

    schema = json.loads((Path(__file__).resolve().parents[2] / "helm" / "values.schema.json").read_text())
    default = yaml.safe_load((Path(__file__).resolve().parents[2] / "helm" / "values.yaml").read_text())
    for config in ("1P1D", "colocated-2"):
        planned = yaml.safe_load(Path(_write(tmp_path, config)).read_text())
        merged = _merge(default, planned)
        jsonschema.validate(merged, schema)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out
