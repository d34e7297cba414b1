"""How .ci/build_image.py hands the host's pip setup to the image build (no buildah needed).

The build must use the same package sources and trust the same certificate authorities as the
host's pip: the merged configuration pip itself resolves, with `cert` moved to the mounted CA copy
(never over the image's own CA file), and every local source mounted at its own path.
"""

from __future__ import annotations

import configparser
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("build_image", ROOT / ".ci" / "build_image.py")
build_image = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_image)


def host_pip(tmp_path: Path, **env: str) -> dict[str, dict[str, str]]:
    """pip_settings() of this interpreter with only a test config file and `env` as configuration."""
    saved = dict(os.environ)
    try:
        for key in list(os.environ):
            if key.startswith("PIP_"):
                del os.environ[key]
        os.environ.update(env)
        return build_image.pip_settings(sys.executable)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_settings_merge_files_and_environment_as_pip_does(tmp_path):
    wheels = tmp_path / "wheels"
    index = tmp_path / "mirror" / "simple"
    wheels.mkdir()
    index.mkdir(parents=True)
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch<=2.14\n")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nfind-links = /nonexistent\nextra-index-url = file://{index}\n"
                    f"constraint = {constraints}\ncert = /etc/ssl/certs/ca-certificates.crt\n"
                    "[install]\nno-compile = true\n")
    settings = host_pip(tmp_path, PIP_CONFIG_FILE=str(conf), PIP_FIND_LINKS=str(wheels))
    assert settings["global"]["find-links"] == str(wheels), "a PIP_* variable overrides every file"
    assert settings["install"]["find-links"] == str(wheels)
    assert settings["global"]["extra-index-url"] == f"file://{index}"
    # Local sources are mounted at their own paths; a file:// index with its parent (../../files links).
    # (A superset: the host's global pip files, which PIP_CONFIG_FILE does not hide, may add their own.)
    sources = build_image.local_sources(settings)
    assert {str(wheels), str(index.parent), str(constraints)} <= sources
    assert str(index) not in sources and "/nonexistent" not in sources

    build_dir = tmp_path / "mount"
    build_dir.mkdir()
    ca = tmp_path / "host-ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    build_image.write_build_config(settings, str(ca), build_dir)
    written = configparser.ConfigParser()
    written.read(build_dir / "pip.conf")
    assert written["global"]["cert"] == f"{build_image.MOUNT_DIR}/ca.crt" != build_image.DEFAULT_CA
    assert written["install"]["cert"] == f"{build_image.MOUNT_DIR}/ca.crt"
    assert written["global"]["find-links"] == str(wheels)
    assert (build_dir / "ca.crt").read_text() == ca.read_text()

    # And pip reads the written file back the same way inside the build.
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            env={"PIP_CONFIG_FILE": str(build_dir / "pip.conf"), "PATH": os.environ["PATH"],
                                 "HOME": str(tmp_path)}, check=True).stdout
    assert f"global.find-links='{wheels}'" in listed
    assert f"global.cert='{build_image.MOUNT_DIR}/ca.crt'" in listed


def test_the_dockerfile_build_stage_takes_the_configuration_and_no_forced_index():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG PIP_CONFIG_FILE\n" in dockerfile
    assert "ARG TORCH_INDEX_URL=\n" in dockerfile, "an empty default lets the mounted configuration pick torch"
    assert '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}' in dockerfile
