"""`helm lint --strict` and strict kubernetes-validate of `helm template` across Kubernetes versions;
NOTES.txt renders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helm_chart import (CHART, OLDEST_KUBE_MINOR, VALUES_SETS, HelmError, helm_kube_minor, kube_versions,
                        kube_versions_where_the_chart_changes, kubernetes_validate_minors, render_text, run_helm)

KUBE_VERSIONS = kube_versions()
# Renders with the optional paths switched on, validated on top of the values files.
VARIANTS: dict[str, tuple[str, ...]] = {
    "nccl-apikey-pvc": ('kvTransport="nccl"', 'router.apiKey.secretName="key"',
                        'model.volume={"type":"pvc","pvc":{"claimName":"weights","subPath":"llama"}}',
                        'model.name="/models/llama"', 'prefill.engine.numBlocks=1024'),
}
# The venv's console script when there is one, else the same tool as a module.
_SCRIPT = Path(sys.executable).with_name("kubernetes-validate")
KUBERNETES_VALIDATE = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "kubernetes_validate"]


def test_version_range_reaches_newest_both_tools_know():
    newest = min(helm_kube_minor(), max(kubernetes_validate_minors()))
    assert KUBE_VERSIONS[0] == f"1.{OLDEST_KUBE_MINOR}.0"
    assert KUBE_VERSIONS[-1] == f"1.{newest}.0"
    assert newest >= 35, "helm v4.1 knows Kubernetes 1.35"


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values_set", sorted(VALUES_SETS))
def test_lint_strict(values_set, kube_version):
    args = ["lint", "--strict", str(CHART), "--kube-version", kube_version]
    for path in VALUES_SETS[values_set]:
        args += ["-f", path]
    out = run_helm(*args)
    assert "0 chart(s) failed" in out


def test_lint_strict_fails_on_invalid_values():
    with pytest.raises(HelmError, match="1 chart\\(s\\) failed"):
        run_helm("lint", "--strict", str(CHART), "--set", "kvTransport=rdma")


def _validate(paths: list[Path], kube_version: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KUBERNETES_VALIDATE, "--strict", "--quiet", "--no-warn",
                           "-k", kube_version, *map(str, paths)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("kube_version", kube_versions_where_the_chart_changes())
def test_rendered_manifests_validate_strictly(kube_version, tmp_path):
    """Every values set renders to manifests the API schemas of that version accept, strictly: at
    both ends of the range and on both sides of each version the templates test for."""
    paths = []
    renders = {name: (files, ()) for name, files in VALUES_SETS.items()}
    renders.update({name: ((), sets) for name, sets in VARIANTS.items()})
    for name, (files, sets) in renders.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(render_text(files, sets, kube_version))
        paths.append(path)
    proc = _validate(paths, kube_version)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_strict_validation_rejects_unknown_fields(tmp_path):
    """Control: the validator is really strict, so the test above can fail."""
    text = render_text((), (), KUBE_VERSIONS[0]).replace(
        "enableServiceLinks: false", "enableServiceLinks: false\n      notAField: true", 1)
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    proc = _validate([path], KUBE_VERSIONS[0])
    assert proc.returncode != 0 and "notAField" in proc.stdout + proc.stderr


def test_notes_explain_access_auth_and_missing_monitoring_crds():
    base = ["install", "cbserve", str(CHART), "--dry-run=client", "--namespace", "llm"]
    notes = run_helm(*base)
    assert "port-forward svc/cbserve-router 8000:80" in notes
    assert "cbserve-adapter-rules" in notes
    assert "no ServiceMonitor/PodMonitor was" in notes, "a client-side dry run has no monitoring CRDs"
    api_key_notes = run_helm(*base, "--set", "router.apiKey.secretName=key")
    assert "get secret key" in api_key_notes
