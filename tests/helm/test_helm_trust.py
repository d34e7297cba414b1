"""Pods trust only their cluster, in the chart: one deployment secret per release, mounted as a
file into the router and every pod (never in args or env), and mutual TLS when given certificates."""

from __future__ import annotations

import base64

import pytest

from helm_chart import HelmError, container, flags, name, render

COMPONENTS = ("router", "prefill", "decode")
TLS = ('tls={"enabled": true, "secretName": "pod-certs", "serverName": "pods.internal"}',)


def _volumes(manifests, component: str) -> dict[str, dict]:
    spec = manifests.get("Deployment", name(component))["spec"]["template"]["spec"]
    return {v["name"]: v for v in spec["volumes"]}


def _mounts(manifests, component: str) -> dict[str, dict]:
    return {m["name"]: m for m in container(manifests.get("Deployment", name(component)))["volumeMounts"]}


def test_a_secret_is_generated_once_and_kept():
    manifests = render()
    secret = manifests.get("Secret", name("cluster-secret"))
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    value = base64.b64decode(secret["data"]["cluster-secret"]).decode()
    assert len(value) == 48 and value.isalnum()
    for component in COMPONENTS:
        main = container(manifests.get("Deployment", name(component)))
        assert flags(main["args"])["cluster-secret-file"] == "/etc/cbserve/cluster-secret/secret"
        volume = _volumes(manifests, component)["cluster-secret"]["secret"]
        assert volume["secretName"] == name("cluster-secret")
        assert volume["items"] == [{"key": "cluster-secret", "path": "secret"}]
        assert _mounts(manifests, component)["cluster-secret"] == {
            "name": "cluster-secret", "mountPath": "/etc/cbserve/cluster-secret", "readOnly": True}
        rendered = str(main)
        assert value not in rendered and "CBSERVE_CLUSTER_SECRET" not in rendered


def test_an_existing_secret_replaces_the_generated_one():
    manifests = render(sets=('clusterSecret={"existingSecret": "mine", "secretKey": "token"}',))
    assert not manifests.has("Secret", name("cluster-secret"))
    for component in COMPONENTS:
        volume = _volumes(manifests, component)["cluster-secret"]["secret"]
        assert volume["secretName"] == "mine" and volume["items"] == [{"key": "token", "path": "secret"}]


def test_tls_mounts_certificates_and_moves_probes_to_the_health_port():
    manifests = render(sets=TLS)
    for component in COMPONENTS:
        args = flags(container(manifests.get("Deployment", name(component)))["args"])
        assert args["tls-cert"] == "/etc/cbserve/tls/tls.crt" and args["tls-key"] == "/etc/cbserve/tls/tls.key"
        assert args["tls-ca"] == "/etc/cbserve/tls/ca.crt" and args["tls-server-name"] == "pods.internal"
        assert _volumes(manifests, component)["tls"]["secret"]["secretName"] == "pod-certs"
        assert _mounts(manifests, component)["tls"]["readOnly"] is True
    for pool in ("prefill", "decode"):
        main = container(manifests.get("Deployment", name(pool)))
        assert flags(main["args"])["health-port"] == "50071"
        assert main["startupProbe"]["grpc"]["port"] == main["readinessProbe"]["grpc"]["port"] == 50071
    plain = render()
    for pool in ("prefill", "decode"):
        main = container(plain.get("Deployment", name(pool)))
        assert "health-port" not in flags(main["args"]) and "tls-cert" not in flags(main["args"])
        assert main["readinessProbe"]["grpc"]["port"] == 50051
        assert "tls" not in _volumes(plain, pool)


def test_tls_without_a_secret_name_fails():
    with pytest.raises(HelmError, match="tls.secretName"):
        render(sets=('tls={"enabled": true, "secretName": "", "serverName": "x"}',))
