"""Each pool's HPA: target, metrics, behaviour; no `replicas` on an HPA-owned Deployment; the
adapter rules serve exactly the metrics the HPAs ask for."""

from __future__ import annotations

import re

import pytest
import yaml

from helm_chart import ROOT, VALUES_SETS, name, render

# Names exported by the pods (DESIGN.md §7, CLI contract); adapter rules may read nothing else.
EXPORTED_HISTOGRAMS = {"cbserve_time_to_first_token_seconds", "cbserve_time_per_output_token_seconds",
                       "cbserve_e2e_request_latency_seconds", "cbserve_kv_transfer_seconds", "cbserve_step_seconds"}
EXPORTED_GAUGES = {"cbserve_requests_running", "cbserve_requests_waiting", "cbserve_prefill_queue_tokens",
                   "cbserve_kv_cache_usage_ratio", "cbserve_prefix_cache_hit_ratio"}


def metrics_by_name(hpa: dict) -> dict[str, dict]:
    out = {}
    for metric in hpa["spec"]["metrics"]:
        body = metric[metric["type"].lower()]
        out[body["metric"]["name"]] = metric
    return out


def adapter_rules(manifests) -> list[dict]:
    configmap = manifests.get("ConfigMap", name("adapter-rules"))
    return yaml.safe_load(configmap["data"]["config.yaml"])["rules"]


def test_prefill_hpa_scales_on_queued_tokens_with_ttft_guard():
    manifests = render()
    hpa = manifests.get("HorizontalPodAutoscaler", name("prefill"))
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name("prefill")}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 8)
    metrics = metrics_by_name(hpa)
    assert set(metrics) == {"cbserve_prefill_queue_tokens", "cbserve_ttft_p95_seconds"}
    queue = metrics["cbserve_prefill_queue_tokens"]
    assert queue["type"] == "Pods"
    assert queue["pods"]["target"] == {"type": "AverageValue", "averageValue": "8192"}
    guard = metrics["cbserve_ttft_p95_seconds"]
    assert guard["type"] == "Object"
    assert guard["object"]["describedObject"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name("prefill")}
    assert guard["object"]["target"] == {"type": "Value", "value": "450m"}  # 90 % of 500 ms


def test_decode_hpa_scales_on_running_requests_and_kv_usage_with_tpot_guard():
    hpa = render().get("HorizontalPodAutoscaler", name("decode"))
    assert hpa["spec"]["scaleTargetRef"]["name"] == name("decode")
    metrics = metrics_by_name(hpa)
    assert set(metrics) == {"cbserve_requests_running", "cbserve_kv_cache_usage_ratio", "cbserve_tpot_p95_seconds"}
    assert metrics["cbserve_requests_running"]["pods"]["target"] == {"type": "AverageValue", "averageValue": "192"}
    assert metrics["cbserve_kv_cache_usage_ratio"]["pods"]["target"] == {"type": "AverageValue", "averageValue": "800m"}
    guard = metrics["cbserve_tpot_p95_seconds"]["object"]
    assert guard["describedObject"]["name"] == name("decode")
    assert guard["target"] == {"type": "Value", "value": "45m"}  # 90 % of 50 ms


def test_targets_follow_slo_and_values():
    manifests = render(sets=("slo.ttftMs=800", "slo.tpotMs=30", "prefill.autoscaling.ttftGuard.percentOfSlo=100",
                             "prefill.autoscaling.targetQueueTokensPerPod=4096",
                             "decode.autoscaling.targetKvCacheUsageRatio=0.65",
                             "decode.autoscaling.targetRunningRequestsPerPod=null"))
    prefill = metrics_by_name(manifests.get("HorizontalPodAutoscaler", name("prefill")))
    decode = metrics_by_name(manifests.get("HorizontalPodAutoscaler", name("decode")))
    assert prefill["cbserve_ttft_p95_seconds"]["object"]["target"]["value"] == "800m"
    assert prefill["cbserve_prefill_queue_tokens"]["pods"]["target"]["averageValue"] == "4096"
    assert decode["cbserve_tpot_p95_seconds"]["object"]["target"]["value"] == "27m"
    assert decode["cbserve_kv_cache_usage_ratio"]["pods"]["target"]["averageValue"] == "650m"
    assert "cbserve_requests_running" not in decode


def test_guards_can_be_disabled():
    manifests = render(sets=("prefill.autoscaling.ttftGuard.enabled=false", "decode.autoscaling.tpotGuard.enabled=false"))
    for pool in ("prefill", "decode"):
        types = {m["type"] for m in manifests.get("HorizontalPodAutoscaler", name(pool))["spec"]["metrics"]}
        assert types == {"Pods"}


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_behavior_scales_up_fast_and_down_slowly(pool):
    behavior = render().get("HorizontalPodAutoscaler", name(pool))["spec"]["behavior"]
    up, down = behavior["scaleUp"], behavior["scaleDown"]
    assert up["stabilizationWindowSeconds"] == 0
    assert up["selectPolicy"] == "Max"
    assert {p["type"] for p in up["policies"]} == {"Percent", "Pods"}
    assert all(p["periodSeconds"] <= 30 for p in up["policies"])
    assert down["stabilizationWindowSeconds"] >= 300
    assert down["selectPolicy"] == "Min"
    assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": down["policies"][0]["periodSeconds"]}]
    assert down["policies"][0]["periodSeconds"] >= 60


@pytest.mark.parametrize("values_set", sorted(VALUES_SETS))
def test_scale_down_period_outlasts_the_grace_period(values_set):
    """One pod per period, and each pod is gone before the next starts draining."""
    manifests = render(VALUES_SETS[values_set])
    for hpa in manifests.of_kind("HorizontalPodAutoscaler"):
        (policy,) = hpa["spec"]["behavior"]["scaleDown"]["policies"]
        pod = manifests.get("Deployment", hpa["spec"]["scaleTargetRef"]["name"])["spec"]["template"]["spec"]
        assert policy["periodSeconds"] >= pod["terminationGracePeriodSeconds"], hpa["metadata"]["name"]


@pytest.mark.parametrize("values_set", sorted(VALUES_SETS))
def test_no_replicas_when_an_hpa_owns_the_deployment(values_set):
    manifests = render(VALUES_SETS[values_set])
    owned = {hpa["spec"]["scaleTargetRef"]["name"] for hpa in manifests.of_kind("HorizontalPodAutoscaler")}
    for deployment in manifests.of_kind("Deployment"):
        if deployment["metadata"]["name"] in owned:
            assert "replicas" not in deployment["spec"], deployment["metadata"]["name"]
        else:
            assert deployment["spec"]["replicas"] >= 1, deployment["metadata"]["name"]
    assert not manifests.has("HorizontalPodAutoscaler", name("router")), "the router is not autoscaled"


def test_fixed_size_pools_render_replicas_and_no_hpa():
    manifests = render(VALUES_SETS["cpu-tiny"])
    assert manifests.of_kind("HorizontalPodAutoscaler") == []
    assert manifests.get("Deployment", name("prefill"))["spec"]["replicas"] == 1
    assert manifests.get("Deployment", name("decode"))["spec"]["replicas"] == 2


def test_colocated_has_no_prefill_pool():
    manifests = render(sets=("prefill.enabled=false",))
    assert not manifests.has("Deployment", name("prefill"))
    assert not manifests.has("HorizontalPodAutoscaler", name("prefill"))
    assert manifests.has("HorizontalPodAutoscaler", name("decode"))


def test_adapter_rules_serve_every_hpa_metric_from_exported_names():
    manifests = render()
    rules = adapter_rules(manifests)
    served = {rule["name"]["as"]: rule for rule in rules}
    for hpa in manifests.of_kind("HorizontalPodAutoscaler"):
        for metric_name, metric in metrics_by_name(hpa).items():
            rule = served[metric_name]
            overrides = rule["resources"]["overrides"]
            assert overrides["namespace"] == {"resource": "namespace"}
            if metric["type"] == "Pods":
                assert overrides["pod"] == {"resource": "pod"}
            else:
                assert overrides["deployment"] == {"group": "apps", "resource": "deployment"}
    for rule in rules:
        series = re.match(r"^([a-z_]+)\{", rule["seriesQuery"]).group(1)
        assert series in EXPORTED_GAUGES or series.removesuffix("_bucket") in EXPORTED_HISTOGRAMS, series


def test_adapter_exposes_per_pod_queue_depth_and_pool_p95():
    served = {rule["name"]["as"]: rule for rule in adapter_rules(render())}
    for gauge in ("cbserve_prefill_queue_tokens", "cbserve_requests_waiting"):
        assert served[gauge]["metricsQuery"] == "max by (<<.GroupBy>>) (<<.Series>>{<<.LabelMatchers>>})"
    for metric, histogram in (("cbserve_ttft_p95_seconds", "cbserve_time_to_first_token_seconds"),
                              ("cbserve_tpot_p95_seconds", "cbserve_time_per_output_token_seconds")):
        rule = served[metric]
        assert rule["seriesQuery"].startswith(f"{histogram}_bucket{{")
        query = rule["metricsQuery"]
        assert "histogram_quantile(0.95, sum by (le, <<.GroupBy>>) (rate(<<.Series>>{<<.LabelMatchers>>}[2m])))" in query
        assert ">= 0" in query and " or " in f" {query} ".replace("\n", " "), "NaN (no traffic) must become 0"


def test_podmonitor_adds_the_deployment_label_the_adapter_maps():
    manifests = render(api_versions=("monitoring.coreos.com/v1",))
    (endpoint,) = manifests.get("PodMonitor", name("engine"))["spec"]["podMetricsEndpoints"]
    (relabel,) = endpoint["relabelings"]
    assert relabel["targetLabel"] == "deployment"
    assert relabel["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
    for pool in ("prefill", "decode"):
        assert relabel["replacement"].replace("$1", pool) == name(pool)
        labels = manifests.get("Deployment", name(pool))["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == pool


@pytest.mark.no_helm
def test_autoscaling_doc_explains_every_signal_with_promql():
    doc = (ROOT / "docs" / "autoscaling.md").read_text()
    for metric in ("cbserve_prefill_queue_tokens", "cbserve_ttft_p95_seconds", "cbserve_requests_running",
                   "cbserve_kv_cache_usage_ratio", "cbserve_tpot_p95_seconds", "stabilizationWindowSeconds"):
        assert metric in doc, metric
    assert "```promql" in doc and "histogram_quantile(0.95" in doc
