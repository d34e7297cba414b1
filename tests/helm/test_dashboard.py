"""The chart's Grafana dashboard: rendered by real helm, loaded as JSON, checked against a schema of
Grafana's dashboard essentials, laid out without overlaps, and covering what an operator needs.

That every series it queries is one cbserve exports is checked against a running cluster in
test_metric_consistency.py.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from helm_chart import ROOT, name, render
from router.metrics import PHASES

SCHEMA = json.loads((ROOT / "tests" / "helm" / "grafana_dashboard.schema.json").read_text())
BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__range"}
LABEL_MATCHER = re.compile(r'\b(role|phase|slo|status)\s*(=~|=|!=|!~)\s*"([^"]*)"')


def dashboard(*sets: str) -> tuple[dict, dict]:
    """(the ConfigMap, its dashboard parsed from JSON) of one rendering."""
    configmap = render(sets=sets).get("ConfigMap", name("dashboard"))
    return configmap, json.loads(configmap["data"]["cbserve.json"])


def panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def expressions(board: dict) -> list[str]:
    exprs = [t["expr"] for p in panels(board) for t in p["targets"]]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_configmap_is_labelled_for_the_grafana_sidecar_and_optional():
    configmap, _ = dashboard()
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "llm"
    configmap, _ = dashboard('monitoring.dashboard={"enabled":true,"namespace":"monitoring",'
                             '"labels":{"grafana_dashboard":"1"},"annotations":{"grafana_folder":"LLM"}}')
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert not render(sets=("monitoring.dashboard.enabled=false",)).has("ConfigMap", name("dashboard"))


def test_dashboard_loads_and_matches_the_grafana_schema():
    _, board = dashboard()
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.validate(board, SCHEMA, cls=jsonschema.Draft202012Validator)


def test_schema_check_rejects_a_broken_dashboard():
    """The schema is not vacuous: the usual hand-editing mistakes fail it."""
    _, board = dashboard()
    broken = [
        {**board, "uid": "has spaces"},
        {**board, "panels": [{**board["panels"][1], "targets": []}]},
        {**board, "panels": [{**board["panels"][1], "gridPos": {"h": 8, "w": 30, "x": 0, "y": 0}}]},
        {**board, "panels": [{**board["panels"][1], "targets": [{"refId": "A"}]}]},
        {key: value for key, value in board.items() if key != "schemaVersion"},
    ]
    for bad in broken:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, SCHEMA, cls=jsonschema.Draft202012Validator)


def test_layout_has_unique_ids_and_no_overlapping_panels():
    _, board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
    for panel in panels(board):
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_every_variable_used_is_defined_and_slo_lines_follow_the_release():
    _, board = dashboard('slo={"ttftMs":750,"tpotMs":40}')
    variables = {v["name"]: v for v in board["templating"]["list"]}
    for expr in expressions(board):
        for used in re.findall(r"\$\{?(\w+)", expr):
            assert used in variables or used in BUILTIN_VARIABLES, (used, expr)
    assert variables["slo_ttft_seconds"]["query"] == "0.75"
    assert variables["slo_tpot_seconds"]["query"] == "0.04"
    for panel in panels(board):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_label_values_are_ones_cbserve_emits():
    _, board = dashboard()
    allowed = {"role": {"router", "prefill", "decode", "colocated"}, "phase": set(PHASES),
               "slo": {"ttft", "tpot", "all"}, "status": {"success", "error", "rejected", "cancelled"}}
    for expr in expressions(board):
        for label, _, value in LABEL_MATCHER.findall(expr):
            assert set(value.split("|")) <= allowed[label], (label, value, expr)


@pytest.mark.parametrize("topic, series", [
    ("goodput and SLO attainment", ["cbserve_slo_met_total", "cbserve_requests_total"]),
    ("TTFT/TPOT/e2e quantiles", ["cbserve_time_to_first_token_seconds_bucket",
                                 "cbserve_time_per_output_token_seconds_bucket",
                                 "cbserve_e2e_request_latency_seconds_bucket"]),
    ("per-phase latency", ["cbserve_request_phase_seconds_bucket", 'phase="pd_gap"']),
    ("queue depth and KV usage per pool", ["cbserve_requests_waiting", "cbserve_prefill_queue_tokens",
                                           "cbserve_kv_cache_usage_ratio", "by (deployment)"]),
    ("preemptions", ["cbserve_preemptions_total"]),
    ("KV transfer bytes and time", ["cbserve_kv_transfer_bytes_total", "cbserve_kv_transfer_seconds_bucket"]),
    ("speculative decoding", ["cbserve_spec_decode_num_drafts_total", "cbserve_spec_decode_num_draft_tokens_total",
                              "cbserve_spec_decode_num_accepted_tokens_total",
                              "cbserve_spec_decode_num_accepted_tokens_per_pos_total",
                              "cbserve_spec_decode_acceptance_length_bucket"]),
    ("LoRA adapters per pod", ["cbserve_lora_requests_info", "running_lora_adapters", "cbserve_lora_adapters"]),
    ("structured outputs", ["cbserve_structured_output_requests_total",
                            "cbserve_structured_output_compile_seconds_bucket",
                            "cbserve_structured_output_compile_cache_hits_total",
                            "cbserve_structured_output_first_token_rejected_total"]),
    ("replicas against HPA targets", ["kube_horizontalpodautoscaler_status_current_replicas",
                                      "kube_horizontalpodautoscaler_spec_max_replicas",
                                      "kube_horizontalpodautoscaler_spec_target_metric"]),
])
def test_dashboard_covers(topic, series):
    _, board = dashboard()
    text = "\n".join(expressions(board))
    missing = [s for s in series if s not in text]
    assert not missing, f"{topic}: no query uses {missing}"
