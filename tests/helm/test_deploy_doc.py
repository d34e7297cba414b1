"""docs/deploy.md, followed step by step against the real chart and tools.

Every helm command exists with the flags it uses; every install/upgrade of ./helm renders with
`helm template` (schema included); every chart value the page names is in values.schema.json;
kubectl commands name objects the chart renders; docker build args are Dockerfile ARGs; build
script and cbserve flags exist; and the page's streaming curl works against a running router.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cbserve.cluster_spec import ClusterSpec
from cbserve.local_cluster import LocalCluster
from helm_chart import CHART, ROOT, run_helm

DOC = (ROOT / "docs" / "deploy.md").read_text()
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
FENCE = re.compile(r"```(\w+)\n(.*?)```", re.S)
VALUE_FLAGS = {"--set", "--set-string", "--set-json"}
TEMPLATE_FLAGS = {"-n", "--namespace", "-f", "--values", *VALUE_FLAGS}
OBJECT_REF = re.compile(r"^(svc|service|deployment|hpa|configmap)/(cbserve-[a-z0-9-]+)$")
KINDS = {"svc": "Service", "service": "Service", "deployment": "Deployment", "hpa": "HorizontalPodAutoscaler",
         "configmap": "ConfigMap"}


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(DOC) if lang == language]


def commands(program: str | None = None) -> list[list[str]]:
    """Each shell command of the bash blocks as argv (continuations joined, comments dropped)."""
    argvs = []
    for body in blocks("bash"):
        for line in body.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv and (program is None or Path(argv[0]).name == program):
                argvs.append(argv)
    return argvs


def flag_names(argv: list[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in argv if arg.startswith("-")]


def schema_has(path: str) -> bool:
    """True when dotted `path` names a property of values.schema.json (following $refs)."""
    node = SCHEMA
    for key in path.split("."):
        while "$ref" in node:
            node = SCHEMA["definitions"][node["$ref"].split("/")[-1]]
        props = node.get("properties")
        if props is not None and key in props:
            node = props[key]
        elif isinstance(node.get("additionalProperties"), dict):     # free-form maps (labels)
            node = node["additionalProperties"]
        else:
            return False
    return True


def chart_commands() -> list[list[str]]:
    return [argv for argv in commands("helm") if argv[1] in ("install", "upgrade") and "./helm" in argv]


def template_args(argv: list[str], tmp_path: Path) -> tuple[list[str], list[str]]:
    """(`helm template` args equivalent to an install/upgrade of ./helm, the value paths it sets)."""
    release = argv[2]
    args, keys = ["template", release, str(CHART)], []
    rest = argv[3:]
    for flag, value in zip(rest, rest[1:]):
        if flag not in TEMPLATE_FLAGS:
            continue
        if flag in ("-f", "--values"):
            path = ROOT / value
            if not path.is_file():     # a file the page writes out itself: its yaml block
                (yaml_block,) = blocks("yaml")
                path = tmp_path / value
                path.write_text(yaml_block)
            value = str(path)
        if flag in VALUE_FLAGS:
            keys.append(value.split("=", 1)[0])
        args += [flag, value]
    return args, keys


def rendered(tmp_path: Path) -> list[dict]:
    """Every document of every install/upgrade the page runs."""
    docs = []
    for argv in chart_commands():
        args, _ = template_args(argv, tmp_path)
        docs += [d for d in yaml.safe_load_all(run_helm(*args)) if d]
    return docs


def test_every_helm_command_and_flag_exists():
    helm = commands("helm")
    assert len(helm) >= 6
    for argv in helm:
        sub = argv[1:3] if argv[1] == "repo" else argv[1:2]
        help_text = run_helm(*sub, "--help")
        for flag in flag_names(argv):
            assert re.search(rf"(^|[\s,]){re.escape(flag)}[\s,=]", help_text, re.M), (flag, argv)


def test_chart_installs_render_and_set_only_schema_values(tmp_path):
    installs = chart_commands()
    assert {argv[1] for argv in installs} == {"install", "upgrade"}
    for argv in installs:
        args, keys = template_args(argv, tmp_path)
        run_helm(*args)          # raises with helm's message, schema violations included
        unknown = [key for key in keys if not schema_has(key)]
        assert not unknown, f"{' '.join(argv)} sets values the schema does not have: {unknown}"


def test_every_value_the_page_names_is_in_the_schema():
    named = set(re.findall(r"`([a-zA-Z]+(?:\.[a-zA-Z0-9]+)+)`", DOC))
    named = {n for n in named if n.split(".")[0] in SCHEMA["properties"]}
    named |= set(yaml.safe_load(blocks("yaml")[0]))
    assert len(named) >= 20, sorted(named)
    missing = sorted(n for n in named if not schema_has(n))
    assert not missing, f"docs/deploy.md names values values.schema.json does not have: {missing}"


def test_kubectl_commands_name_objects_the_chart_renders(tmp_path):
    docs = rendered(tmp_path)
    objects = {(d["kind"], d["metadata"]["name"]) for d in docs}
    labels = {f"{k}={v}" for d in docs for k, v in d["metadata"].get("labels", {}).items()}
    service_ports = {d["metadata"]["name"]: {p["port"] for p in d["spec"]["ports"]}
                     for d in docs if d["kind"] == "Service"}
    adapter_metrics = {rule["name"]["as"] for d in docs if d["kind"] == "ConfigMap" and "config.yaml" in d["data"]
                       for rule in yaml.safe_load(d["data"]["config.yaml"])["rules"]}
    kubectl = commands("kubectl")
    assert len(kubectl) >= 6
    forwards = 0
    for argv in kubectl:
        for i, arg in enumerate(argv):
            match = OBJECT_REF.match(arg)
            if match:
                kind, object_name = KINDS[match.group(1)], match.group(2)
                assert (kind, object_name) in objects, (kind, object_name, argv)
                if "port-forward" in argv:
                    assert int(argv[i + 1].split(":")[1]) in service_ports[object_name], argv
                    forwards += 1
            if arg == "-l":
                assert argv[i + 1] in labels, argv
            if "custom.metrics.k8s.io" in arg:
                assert arg.rsplit("/", 1)[1] in adapter_metrics, arg
    assert forwards >= 2
    # Names the page gives in prose and in other charts' settings.
    for kind, object_name in (("ConfigMap", "cbserve-adapter-rules"), ("ConfigMap", "cbserve-dashboard")):
        assert (kind, object_name) in objects and object_name in DOC


def test_docker_build_args_are_dockerfile_args():
    declared = set(re.findall(r"^ARG (\w+)", (ROOT / "Dockerfile").read_text(), re.M))
    builds = commands("docker")
    assert any(argv[1] == "build" for argv in builds)
    for argv in builds:
        for flag, value in zip(argv, argv[1:]):
            if flag == "--build-arg":
                assert value.split("=", 1)[0] in declared, value
    assert "PIP_CONFIG_FILE" in declared and "PIP_CONFIG_FILE" in DOC


def test_build_script_and_buildah_flags_exist():
    (build,) = [argv for argv in commands() if any(a.endswith(".ci/build_image.py") for a in argv)]
    script = next(a for a in build if a.endswith(".ci/build_image.py"))
    help_text = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                               check=True).stdout
    for flag in flag_names(build):
        assert flag in help_text, flag
    if shutil.which("buildah") is None:
        pytest.skip("buildah is not installed; its flags are not checked")
    for argv in commands("buildah"):
        # buildah GLOBAL-FLAGS VALUE... SUBCOMMAND ...: every global flag here takes a value.
        sub = next(arg for i, arg in enumerate(argv[1:], 1) if not arg.startswith("-") and not argv[i - 1].startswith("-"))
        help_text = "".join(subprocess.run(["buildah", *cmd, "--help"], capture_output=True, text=True,
                                           check=True).stdout for cmd in ([], [sub]))
        for flag in flag_names(argv):
            assert flag in help_text, flag


def notes(*args: str) -> str:
    return run_helm("install", "cbserve", str(CHART), "--dry-run=client", "--namespace", "llm", *args).split("NOTES:", 1)[1]


@pytest.mark.parametrize("values", [(), ("-f", str(CHART / "examples" / "cpu-tiny.yaml"))], ids=["default", "cpu-tiny"])
def test_install_notes_say_what_next_and_how_to_see_the_slo_metrics(values):
    text = notes(*values)
    (page_curl,) = [" ".join(a) for a in commands("curl") if any("/v1/completions" in arg for arg in a)]
    body = page_curl.split(" -d ", 1)[1]
    assert "port-forward svc/cbserve-router 8000:80" in text
    assert "curl -N localhost:8000/v1/completions" in text and f"-d '{body}'" in text
    assert "cbserve_slo_met_total{slo=\"all\"} / cbserve_requests_total" in text
    assert 'sum(rate(cbserve_slo_met_total{namespace="llm",slo="all"}[5m]))' in text
    assert 'dashboard "cbserve" (ConfigMap cbserve-dashboard in namespace llm' in text
    assert 'grafana_dashboard="1"' in text and "docs/deploy.md" in text
    assert ("get hpa -l app.kubernetes.io/instance=cbserve -w" in text) == (not values)
    assert "Grafana" not in notes(*values, "--set", "monitoring.dashboard.enabled=false")


@pytest.mark.slow
def test_the_streaming_curl_answers_from_a_running_router():
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    curls = commands("curl")
    (completion,) = [argv for argv in curls if any("/v1/completions" in arg for arg in argv)]
    (metrics,) = [argv for argv in curls if any(arg.endswith("/metrics") for arg in argv)]
    assert "-N" in completion and '"stream": true' in " ".join(completion)
    spec = ClusterSpec(model="tiny", port=0, threads_per_pod=1, drain_seconds=5.0)
    outputs = []
    with LocalCluster(spec) as cluster:
        host_port = cluster.base_url.split("//", 1)[1].split("/", 1)[0]
        for curl in (completion, metrics):     # the page's order: answer first, then its metrics
            argv = [arg.replace("localhost:8000", host_port) for arg in curl]
            proc = subprocess.run([*argv, "--fail", "--silent", "--show-error", "--max-time", "120"],
                                  capture_output=True, text=True, timeout=180)
            assert proc.returncode == 0, (argv, proc.stderr)
            outputs.append(proc.stdout)
    assert 'cbserve_requests_total{role="router",status="success"} 1.0' in outputs[1]
    events = [line[len("data: "):] for line in outputs[0].splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3, outputs[0]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
    assert text
