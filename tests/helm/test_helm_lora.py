"""The chart's LoRA values (real helm): flags on both pools and the router, per-pool overrides,
the adapter volume mounted read-only where runtime loads are rooted, and clear failures for
values that would not serve (duplicate names, paths outside the volume, runtime loading without
a volume, names the engine refuses)."""

from __future__ import annotations

import json

import pytest

from helm_chart import HelmError, container, name, render

ENABLED = ('lora={"enabled": true, "maxLoras": 4, "maxCpuLoras": 8, "maxLoraRank": 32, '
           '"modules": [{"name": "sql", "path": "/adapters/sql"}, {"name": "chat", "path": "/adapters/chat"}], '
           '"allowRuntimeUpdating": true, "volume": {"type": "pvc", "mountPath": "/adapters", '
           '"pvc": {"claimName": "adapters", "subPath": "v1"}, "hostPath": {"path": "", "type": "Directory"}}}')


def _args(manifests, component: str) -> list[str]:
    return container(manifests.get("Deployment", name(component)))["args"]


def test_off_by_default():
    manifests = render()
    for component in ("prefill", "decode", "router"):
        args = _args(manifests, component)
        assert not [a for a in args if "lora" in a], args
        pod = manifests.get("Deployment", name(component))["spec"]["template"]["spec"]
        assert "lora-adapters" not in {v["name"] for v in pod.get("volumes", [])}


def test_both_pools_serve_the_adapters_from_the_read_only_volume():
    manifests = render(sets=(ENABLED, 'decode.lora={"maxLoras": 16}'))
    for pool, slots in (("prefill", "4"), ("decode", "16")):
        args = _args(manifests, pool)
        assert {"--enable-lora", f"--max-loras={slots}", "--max-cpu-loras=8", "--max-lora-rank=32",
                "--lora-modules=sql=/adapters/sql", "--lora-modules=chat=/adapters/chat",
                "--allow-runtime-lora-updating", "--lora-root=/adapters"} <= set(args), args
        spec = manifests.get("Deployment", name(pool))["spec"]["template"]["spec"]
        (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "lora-adapters"]
        assert mount == {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True, "subPath": "v1"}
        (volume,) = [v for v in spec["volumes"] if v["name"] == "lora-adapters"]
        assert volume["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
    router = _args(manifests, "router")
    assert "--enable-lora" in router and "--allow-runtime-lora-updating" in router


def test_host_path_volume_and_no_runtime_loading():
    values = json.loads(ENABLED.partition("=")[2])
    values.update(allowRuntimeUpdating=False, volume={"type": "hostPath", "mountPath": "/lora", "pvc": {
        "claimName": "", "subPath": ""}, "hostPath": {"path": "/srv/adapters", "type": "Directory"}},
        modules=[{"name": "sql", "path": "/lora/sql"}])
    manifests = render(sets=("lora=" + json.dumps(values),))
    spec = manifests.get("Deployment", name("decode"))["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "lora-adapters"]
    assert volume["hostPath"] == {"path": "/srv/adapters", "type": "Directory"}
    assert not [a for a in _args(manifests, "decode") if "runtime" in a or "lora-root" in a]
    assert "--allow-runtime-lora-updating" not in _args(manifests, "router")


@pytest.mark.parametrize("change, message", [
    ({"modules": [{"name": "a", "path": "/adapters/a"}, {"name": "a", "path": "/adapters/b"}]}, "twice"),
    ({"modules": [{"name": "a", "path": "/elsewhere/a"}]}, "outside lora.volume.mountPath"),
    ({"volume": {"type": "none", "mountPath": "/adapters", "pvc": {"claimName": "", "subPath": ""},
                 "hostPath": {"path": "", "type": "Directory"}}}, "needs lora.volume"),
    ({"modules": [{"name": "a,b", "path": "/adapters/a"}]}, "pattern"),
    ({"maxLoraRank": 1024}, "maximum"),
])
def test_values_that_would_not_serve_fail_to_render(change, message):
    values = json.loads(ENABLED.partition("=")[2])
    values.update(change)
    with pytest.raises(HelmError, match=message):
        render(sets=("lora=" + json.dumps(values),))
