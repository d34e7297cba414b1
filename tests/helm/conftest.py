"""Chart tests need the real helm binary; without one they skip with the reason (CI installs it).

Tests marked `no_helm` read files only (schema, values.yaml, Dockerfile, docs) and always run.
"""

from __future__ import annotations

import pytest

from helm_chart import find_helm


def pytest_configure(config):
    config.addinivalue_line("markers", "no_helm: chart test that reads files only and runs without helm")


def pytest_collection_modifyitems(config, items):
    if find_helm() is not None:
        return
    skip = pytest.mark.skip(
        reason="no helm binary: set CBSERVE_HELM, run `.ci/install_helm.sh .tools/bin`, or put helm on PATH")
    for item in items:
        in_chart_tests = "tests/helm/" in str(item.fspath).replace("\\", "/")
        if in_chart_tests and "no_helm" not in item.keywords:
            item.add_marker(skip)
