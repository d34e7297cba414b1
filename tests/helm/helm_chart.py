"""Run the real helm binary against the chart and parse what it renders.

Helm is found via $CBSERVE_HELM, then <repo>/.tools/bin/helm (what .ci/install_helm.sh installs),
then PATH; tests skip with the reason when none exists. Renders are cached per argument set, so
the many assertions over one rendering cost one helm call.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
RELEASE = "cbserve"
NAMESPACE = "llm"
OLDEST_KUBE_MINOR = 29
KV_SCHEMA_DIR_PATTERN = re.compile(r"^v1\.(\d+)\.0-local-strict$")

# Values sets every cross-version check covers: the defaults plus each example file.
VALUES_SETS: dict[str, tuple[str, ...]] = {"default": ()}
VALUES_SETS.update({path.stem: (str(path),) for path in EXAMPLES})


class HelmError(RuntimeError):
    """helm exited non-zero; the message carries its stderr."""


def find_helm() -> str | None:
    """Path of a helm binary that runs, or None."""
    candidates = [os.environ.get("CBSERVE_HELM"), str(ROOT / ".tools" / "bin" / "helm"), shutil.which("helm")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def run_helm(*args: str) -> str:
    """Run helm with `args`; return stdout or raise HelmError with stderr."""
    helm = find_helm()
    if helm is None:
        raise HelmError("no helm binary (set CBSERVE_HELM or run .ci/install_helm.sh)")
    proc = subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise HelmError(proc.stderr.strip() or proc.stdout.strip())
    return proc.stdout


@functools.lru_cache(maxsize=1)
def helm_kube_minor() -> int:
    """Newest Kubernetes minor the helm binary was built against (its KubeClientVersion)."""
    version = run_helm("version", "--template", "{{.KubeClientVersion}}").strip()  # "v1.35"
    return int(version.split(".")[1])


def kubernetes_validate_minors() -> list[int]:
    """Kubernetes minors kubernetes-validate has strict schemas for."""
    import kubernetes_validate

    schema_root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    matches = (KV_SCHEMA_DIR_PATTERN.match(p.name) for p in schema_root.iterdir())
    return sorted(int(m.group(1)) for m in matches if m)


def kube_versions() -> list[str]:
    """1.29 up to the newest minor both helm and kubernetes-validate know, as x.y.0 strings.

    Called at collection time; without helm it returns the oldest version only (the tests skip).
    """
    if find_helm() is None:
        return [f"1.{OLDEST_KUBE_MINOR}.0"]
    newest = min(helm_kube_minor(), max(kubernetes_validate_minors()))
    return [f"1.{minor}.0" for minor in range(OLDEST_KUBE_MINOR, newest + 1)]


def kube_versions_where_the_chart_changes() -> list[str]:
    """Of `kube_versions()`: the oldest, the newest, and each version a template tests with
    `semverCompare ">=1.N-0"` (the chart renders the same manifests between those). Schemas only
    gain fields and lose deprecated APIs from one minor to the next, so manifests that one rendering
    gives and both ends of its range accept strictly are accepted in between."""
    versions = kube_versions()
    minors = {int(v.split(".")[1]) for v in (versions[0], versions[-1])}
    for template in (CHART / "templates").rglob("*"):
        if template.is_file():
            for m in re.findall(r'semverCompare ">=1\.(\d+)', template.read_text()):
                minors.update((int(m) - 1, int(m)))      # the last version before the change, the first after
    return [v for v in versions if int(v.split(".")[1]) in minors]


def template_args(values_files: tuple[str, ...] = (), sets: tuple[str, ...] = (), kube_version: str | None = None,
                  api_versions: tuple[str, ...] = ()) -> list[str]:
    """Command-line arguments of `helm template` for one rendering."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for path in values_files:
        args += ["-f", path]
    for item in sets:
        args += ["--set-json", item]
    if kube_version:
        args += ["--kube-version", kube_version]
    for api_version in api_versions:
        args += ["--api-versions", api_version]
    return args


@functools.lru_cache(maxsize=256)
def render_text(values_files: tuple[str, ...] = (), sets: tuple[str, ...] = (), kube_version: str | None = None,
                api_versions: tuple[str, ...] = ()) -> str:
    """The YAML stream `helm template` prints. `sets` are --set-json items ("key=json")."""
    return run_helm(*template_args(values_files, sets, kube_version, api_versions))


@dataclass(frozen=True)
class Manifests:
    """The documents of one rendering, indexed by (kind, name)."""

    docs: tuple[dict, ...]

    def of_kind(self, kind: str) -> list[dict]:
        return [doc for doc in self.docs if doc["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        for doc in self.of_kind(kind):
            if doc["metadata"]["name"] == name:
                return doc
        raise KeyError(f"no {kind} named {name}; have {[d['metadata']['name'] for d in self.of_kind(kind)]}")

    def has(self, kind: str, name: str) -> bool:
        return any(doc["metadata"]["name"] == name for doc in self.of_kind(kind))


def render(values_files: tuple[str, ...] = (), sets: tuple[str, ...] = (), kube_version: str | None = None,
           api_versions: tuple[str, ...] = ()) -> Manifests:
    """Render and parse; empty documents are dropped."""
    text = render_text(tuple(values_files), tuple(sets), kube_version, tuple(api_versions))
    return Manifests(tuple(doc for doc in yaml.safe_load_all(text) if doc))


def name(component: str) -> str:
    """Object name of a component for the test release ("cbserve" contains the chart name)."""
    return f"{RELEASE}-{component}"


def container(deployment: dict) -> dict:
    """The one main container of a Deployment."""
    (main,) = deployment["spec"]["template"]["spec"]["containers"]
    return main


def flags(args: list[str]) -> dict[str, str | bool]:
    """`--key=value` args to {key: value}; bare `--key` to {key: True}."""
    parsed: dict[str, str | bool] = {}
    for arg in args:
        if arg.startswith("--"):
            key, sep, value = arg[2:].partition("=")
            parsed[key] = value if sep else True
    return parsed
