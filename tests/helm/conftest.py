"""Chart tests need the real helm binary; without one they skip with the reason (CI installs it)."""

from __future__ import annotations

import pytest

from helm_chart import find_helm


def pytest_collection_modifyitems(config, items):
    if find_helm() is not None:
        return
    skip = pytest.mark.skip(
        reason="no helm binary: set CBSERVE_HELM, run `.ci/install_helm.sh .tools/bin`, or put helm on PATH")
    for item in items:
        if "tests/helm/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
