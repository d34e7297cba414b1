"""Every metric the adapter rules, HPAs and the Grafana dashboard reference is exported by a running
pod or router.

The chart is rendered by the real helm binary; the processes are a real local cluster (router +
prefill + decode on the tiny model) that has served one request.
"""

from __future__ import annotations

import json
import re
import urllib.request

import httpx
import pytest
import yaml

from cbserve.cluster_spec import ClusterSpec
from cbserve.local_cluster import LocalCluster
from helm_chart import run_helm, CHART, EXAMPLES

SERIES = re.compile(r"^\s*'?([a-zA-Z_:][a-zA-Z0-9_:]*)\{")
CBSERVE_SERIES = re.compile(r"\b(cbserve_[a-zA-Z0-9_]+)")
# Series a declared family exposes (prometheus_client), so a labelled counter that has not counted
# yet (cbserve_slo_met when the one request missed its SLO under load) still counts as exported.
FAMILY_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                   "gauge": ("",), "summary": ("_sum", "_count", "_created")}


def _render(*values: str) -> list[dict]:
    args = ["template", "cbserve", str(CHART)]
    for v in values:
        args += ["-f", v]
    return [d for d in yaml.safe_load_all(run_helm(*args)) if d]


def _references(docs: list[dict]) -> tuple[set[str], set[str], set[str]]:
    """(raw series the adapter rules read, names the adapter exposes, names the HPAs ask for)."""
    series, exposed, wanted = set(), set(), set()
    for doc in docs:
        if doc["kind"] == "ConfigMap" and "config.yaml" in doc.get("data", {}):
            for rule in yaml.safe_load(doc["data"]["config.yaml"]).get("rules", []):
                series.add(SERIES.match(rule["seriesQuery"]).group(1))
                exposed.add(rule["name"]["as"])
        if doc["kind"] == "HorizontalPodAutoscaler":
            for metric in doc["spec"]["metrics"]:
                source = metric.get(metric["type"][0].lower() + metric["type"][1:])
                if "metric" in source:
                    wanted.add(source["metric"]["name"])
    return series, exposed, wanted


@pytest.fixture(scope="module")
def scraped() -> list[str]:
    """The /metrics bodies of a router, a prefill and a decode pod that served one request."""
    spec = ClusterSpec(model="tiny", port=0, threads_per_pod=1, drain_seconds=5.0)
    with LocalCluster(spec) as cluster:
        response = httpx.post(cluster.base_url + "/completions", timeout=60,
                              json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
        assert response.status_code == 200
        return [urllib.request.urlopen(url, timeout=10).read().decode()
                for url in [cluster.metrics_url] + [p.metrics_url for p in cluster.pods]]


@pytest.fixture(scope="module")
def exported(scraped) -> set[str]:
    """Series names with at least one sample."""
    return {line.split("{")[0].split(" ")[0] for text in scraped for line in text.splitlines()
            if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def declared(scraped, exported) -> set[str]:
    """Series names with a sample, or that a declared (# TYPE) family exposes once it has one."""
    names = set(exported)
    for text in scraped:
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, family, kind = line.split()
                names |= {family.removesuffix("_total") + suffix for suffix in FAMILY_SUFFIXES.get(kind, ())}
    return names


@pytest.mark.parametrize("values", [(), *[(str(p),) for p in EXAMPLES]], ids=lambda v: v[0].split("/")[-1] if v else "default")
def test_adapter_and_hpa_metrics_are_exported(exported, values):
    series, exposed, wanted = _references(_render(*values))
    if values and not (series or wanted):
        pytest.skip("this values file renders no autoscaling")
    assert series and wanted, "the default values must render adapter rules and HPAs"
    missing = sorted(s for s in series if s not in exported)
    assert not missing, f"adapter rules read series no process exports: {missing}"
    unknown = sorted(wanted - exposed)
    assert not unknown, f"HPAs ask for metrics the adapter does not expose: {unknown}"


def test_dashboard_queries_only_exported_series(declared):
    """Each cbserve_* series a dashboard panel or variable queries exists in some process's /metrics."""
    configmap = next(d for d in _render() if d["kind"] == "ConfigMap" and "cbserve.json" in d.get("data", {}))
    board = json.loads(configmap["data"]["cbserve.json"])
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    queried = {name for expr in exprs for name in CBSERVE_SERIES.findall(expr)}
    assert len(queried) >= 15, sorted(queried)
    missing = sorted(queried - declared)
    assert not missing, f"the dashboard queries series no process exports: {missing}"
