"""Who may do what: RBAC for discovery only, NetworkPolicy shape, one budget per PDB, monitors
only with their CRDs."""

from __future__ import annotations

import pytest

from helm_chart import NAMESPACE, VALUES_SETS, container, flags, name, render

SERVING = {"prefill", "decode"}


def component_selector(component: str) -> dict:
    return {"app.kubernetes.io/name": "cbserve", "app.kubernetes.io/instance": "cbserve",
            "app.kubernetes.io/component": component}


# --- RBAC ------------------------------------------------------------------------------------

def test_router_role_grants_only_list_and_watch_on_endpointslices():
    manifests = render()
    (role,) = manifests.of_kind("Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["list", "watch"]}]
    assert manifests.of_kind("ClusterRole") == [] and manifests.of_kind("ClusterRoleBinding") == []


def test_only_the_router_identity_is_bound_and_has_a_token():
    manifests = render()
    (binding,) = manifests.of_kind("RoleBinding")
    (account,) = manifests.of_kind("ServiceAccount")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name("router")}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}]
    router_pod = manifests.get("Deployment", name("router"))["spec"]["template"]["spec"]
    assert router_pod["serviceAccountName"] == account["metadata"]["name"]
    assert router_pod["automountServiceAccountToken"] is True
    for pool in SERVING:
        pod = manifests.get("Deployment", name(pool))["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in pod


def test_router_discovers_the_rendered_headless_services():
    manifests = render()
    args = flags(container(manifests.get("Deployment", name("router")))["args"])
    assert args["discovery"] == "kubernetes" and args["namespace"] == NAMESPACE
    for pool in SERVING:
        service = manifests.get("Service", args[f"{pool}-service"])
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"] == component_selector(pool)
        assert args["grpc-port-name"] in {port["name"] for port in service["spec"]["ports"]}


# --- NetworkPolicy ---------------------------------------------------------------------------

def policy_rules(manifests, component: str) -> dict[str, list[dict]]:
    """{port name or number: [peers]} of a component's ingress policy."""
    policy = manifests.get("NetworkPolicy", name(component))
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"] == {"matchLabels": component_selector(component)}
    rules: dict[str, list[dict]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            rules[str(port["port"])] = rule.get("from", [])
    return rules


def pod_peer(component: str) -> dict:
    return {"podSelector": {"matchLabels": component_selector(component)}}


MONITORING_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def test_grpc_ports_only_from_router_and_kv_pulls_metrics_only_from_monitoring():
    manifests = render()
    prefill, decode = policy_rules(manifests, "prefill"), policy_rules(manifests, "decode")
    # Decode pods pull KV from the prefill pod's gRPC port (PullKV); nobody else but the router.
    assert prefill["grpc"] == [pod_peer("router"), pod_peer("decode")]
    assert decode["grpc"] == [pod_peer("router")]
    assert prefill["metrics"] == decode["metrics"] == [MONITORING_PEER]
    assert set(prefill) == set(decode) == {"grpc", "metrics"}, "no KV ports with the gRPC transport"
    assert policy_rules(manifests, "router") == {"http": []}, "router open to clients by default"


def test_nccl_kv_ports_only_between_serving_pods():
    manifests = render(sets=('kvTransport="nccl"',))
    serving_peer = {"podSelector": {
        "matchLabels": {"app.kubernetes.io/name": "cbserve", "app.kubernetes.io/instance": "cbserve"},
        "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"]}]}}
    for pool in SERVING:
        policy = manifests.get("NetworkPolicy", name(pool))
        (kv_rule,) = [r for r in policy["spec"]["ingress"] if any(p["port"] == "kv-store" for p in r["ports"])]
        assert kv_rule["from"] == [serving_peer]
        assert {"port": 32768, "endPort": 60999, "protocol": "TCP"} in kv_rule["ports"]
        ports = {p["name"]: p["containerPort"] for p in container(manifests.get("Deployment", name(pool)))["ports"]}
        assert ports["kv-store"] == 50061
    assert "kv-store" not in policy_rules(manifests, "router")


def test_every_rendered_port_is_covered_by_a_policy():
    manifests = render(sets=('kvTransport="nccl"',))
    for component in ("router", *SERVING):
        covered = set(policy_rules(manifests, component))
        ports = {p["name"] for p in container(manifests.get("Deployment", name(component)))["ports"]}
        assert ports <= covered, (component, ports - covered)


def test_restricted_router_ingress_still_admits_monitoring():
    manifests = render(VALUES_SETS["gpu-llama3-8b"])
    peers = policy_rules(manifests, "router")["http"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}} in peers
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}} in peers


def test_network_policies_follow_toggles():
    assert render(VALUES_SETS["colocated-minimal"]).of_kind("NetworkPolicy") == []
    colocated = render(sets=("prefill.enabled=false",))
    assert {p["metadata"]["name"] for p in colocated.of_kind("NetworkPolicy")} == {name("router"), name("decode")}


# --- PodDisruptionBudgets --------------------------------------------------------------------

@pytest.mark.parametrize("values_set", sorted(VALUES_SETS))
def test_each_pdb_sets_exactly_one_budget_and_selects_its_pods(values_set):
    manifests = render(VALUES_SETS[values_set])
    for pdb in manifests.of_kind("PodDisruptionBudget"):
        spec = pdb["spec"]
        assert len({"minAvailable", "maxUnavailable"} & set(spec)) == 1, pdb["metadata"]["name"]
        deployment = manifests.get("Deployment", pdb["metadata"]["name"])
        assert spec["selector"] == deployment["spec"]["selector"]
        assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_pdb_min_available_replaces_max_unavailable():
    manifests = render(VALUES_SETS["gpu-hostpath-qwen2-7b"])
    assert manifests.get("PodDisruptionBudget", name("decode"))["spec"] == {
        "minAvailable": "80%", "unhealthyPodEvictionPolicy": "AlwaysAllow",
        "selector": {"matchLabels": component_selector("decode")}}
    assert manifests.get("PodDisruptionBudget", name("prefill"))["spec"]["maxUnavailable"] == 1
    assert render(VALUES_SETS["colocated-minimal"]).of_kind("PodDisruptionBudget") == []


# --- ServiceMonitor / PodMonitor -------------------------------------------------------------

def test_monitors_render_only_when_the_crds_exist():
    without = render()
    assert without.of_kind("ServiceMonitor") == [] and without.of_kind("PodMonitor") == []
    with_crds = render(api_versions=("monitoring.coreos.com/v1",))
    (service_monitor,) = with_crds.of_kind("ServiceMonitor")
    (pod_monitor,) = with_crds.of_kind("PodMonitor")
    assert service_monitor["apiVersion"] == pod_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert service_monitor["spec"]["selector"] == {"matchLabels": component_selector("router")}
    assert service_monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = service_monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    selector = pod_monitor["spec"]["selector"]
    assert selector["matchExpressions"] == [{"key": "app.kubernetes.io/component", "operator": "In",
                                             "values": ["prefill", "decode"]}]
    (pod_endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert (pod_endpoint["port"], pod_endpoint["path"]) == ("metrics", "/metrics")


def test_monitor_labels_and_toggles():
    manifests = render(VALUES_SETS["gpu-llama3-8b"], api_versions=("monitoring.coreos.com/v1",))
    for kind in ("ServiceMonitor", "PodMonitor"):
        (monitor,) = manifests.of_kind(kind)
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    off = render(VALUES_SETS["colocated-minimal"], api_versions=("monitoring.coreos.com/v1",))
    assert off.of_kind("ServiceMonitor") == [] and off.of_kind("PodMonitor") == []


# --- the API key and the router's request cap ---------------------------------------------------

def test_only_the_router_gets_the_api_key_and_it_caps_request_bodies():
    """Issue 11, case 10: pods never check the API key, so no pod container may see it."""
    manifests = render(sets=('router.apiKey={"secretName":"openai-key","secretKey":"api-key"}',
                             "router.maxRequestBodyBytes=1048576"))
    router = container(manifests.get("Deployment", name("router")))
    assert flags(router["args"])["max-request-body-bytes"] == "1048576"
    assert [e["valueFrom"]["secretKeyRef"]["name"] for e in router["env"] if e["name"] == "CBSERVE_API_KEY"] == [
        "openai-key"]
    for pool in SERVING:
        pod = manifests.get("Deployment", name(pool))["spec"]["template"]["spec"]
        for main in pod["containers"] + pod.get("initContainers", []):
            assert all(e["name"] != "CBSERVE_API_KEY" for e in main.get("env", []))
            assert "openai-key" not in str(main)
    default = container(render().get("Deployment", name("router")))
    assert flags(default["args"])["max-request-body-bytes"] == str(16 << 20)
