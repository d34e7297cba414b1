"""The Dockerfile builds the image the chart runs: same user, ports, entrypoint and cache dir.

No container engine runs in CI, so these read the Dockerfile; the chart side comes from a render.
"""

from __future__ import annotations

import re
import tomllib

import pytest

from helm_chart import ROOT, container, flags, name, render

DOCKERFILE = (ROOT / "Dockerfile").read_text()
INSTRUCTIONS = [line.strip() for line in re.sub(r"\\\n", " ", DOCKERFILE).splitlines()
                if line.strip() and not line.lstrip().startswith("#")]


def stages() -> dict[str, list[str]]:
    """Stage name -> its instructions, from its FROM line on."""
    starts = [i for i, line in enumerate(INSTRUCTIONS) if line.startswith("FROM ")] + [len(INSTRUCTIONS)]
    return {INSTRUCTIONS[a].split()[-1]: INSTRUCTIONS[a:b] for a, b in zip(starts, starts[1:])}


def final_stage() -> list[str]:
    return list(stages().values())[-1]


def lineage(stage: list[str]) -> list[str]:
    """The stage's instructions preceded by those of the stages it is built FROM."""
    parent = stage[0].split()[1]
    named = stages()
    return (lineage(named[parent]) if parent in named else []) + stage


def instruction(stage: list[str], keyword: str) -> list[str]:
    return [line[len(keyword) + 1:] for line in stage if line.startswith(keyword + " ")]


@pytest.mark.no_helm
def test_image_is_built_on_a_cuda_base_by_default():
    """BASE_IMAGE (default: the CUDA base) is the one external image; later stages build on earlier ones."""
    (base_arg,) = [line for line in INSTRUCTIONS if line.startswith("ARG BASE_IMAGE=")]
    assert base_arg.split("=", 1)[1].startswith("nvidia/cuda:")
    for name, stage in stages().items():
        parent = stage[0].split()[1]
        assert parent == "${BASE_IMAGE}" or parent in stages(), (name, parent)
    assert lineage(final_stage())[0].split()[1] == "${BASE_IMAGE}"


@pytest.mark.no_helm
def test_runtime_keeps_what_triton_compiles_with_and_tini():
    installs = " ".join(instruction(lineage(final_stage()), "RUN"))
    for package in ("python3-dev", "gcc", "tini"):
        assert package in installs, package


def test_entrypoint_runs_cbserve_so_the_chart_passes_only_args():
    (entrypoint,) = instruction(final_stage(), "ENTRYPOINT")
    assert entrypoint == '["/usr/bin/tini", "--", "cbserve"]'
    for component in ("router", "prefill", "decode"):
        main = container(render().get("Deployment", name(component)))
        assert "command" not in main and main["args"][0] == component


def test_user_matches_the_chart_security_context():
    (user,) = instruction(final_stage(), "USER")
    pod = render().get("Deployment", name("decode"))["spec"]["template"]["spec"]["securityContext"]
    assert user == f"{pod['runAsUser']}:{pod['runAsGroup']}"
    assert pod["runAsNonRoot"] is True


def test_exposed_ports_match_the_chart():
    exposed = {int(port) for line in instruction(final_stage(), "EXPOSE") for port in line.split()}
    manifests = render(sets=('kvTransport="nccl"',))
    ports = {p["containerPort"] for c in ("router", "prefill", "decode")
             for p in container(manifests.get("Deployment", name(c)))["ports"]}
    assert ports == exposed


def test_tiny_preset_cache_dir_matches_the_chart_mount():
    env = " ".join(instruction(final_stage(), "ENV"))
    image_cache = re.search(r"CBSERVE_CACHE_DIR=(\S+)", env).group(1)
    main = container(render().get("Deployment", name("prefill")))
    chart_env = {e["name"]: e.get("value") for e in main["env"]}
    assert chart_env["CBSERVE_CACHE_DIR"] == image_cache
    assert flags(main["args"])["model"] == "tiny"


@pytest.mark.no_helm
def test_image_installs_every_package_the_project_ships():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {line.split()[0].rstrip("/") for line in instruction(INSTRUCTIONS, "COPY") if not line.startswith("--from")}
    assert packages <= copied, packages - copied
    assert any("pip install ." in line for line in instruction(INSTRUCTIONS, "RUN"))


@pytest.mark.no_helm
def test_dockerignore_keeps_local_state_out_of_the_context():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".tools", "tests", "helm"} <= ignored
    assert not ({"engine", "kernels", "router", "cbserve", "proto", "pyproject.toml", "README.md"} & ignored)

