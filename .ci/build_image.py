#!/usr/bin/env python3
"""Build the repository's Dockerfile with no container daemon and no registry (CI, as root).

    python .ci/build_image.py [--tag localhost/cbserve:ci] [--store .cache/image]

1. A Debian 12 root filesystem made with `debootstrap --variant=minbase` becomes the local image
   `localhost/cbserve-base:bookworm` (the CUDA base the Dockerfile defaults to cannot be pulled
   here; BASE_IMAGE swaps it). The debootstrap tarball is cached in the store for later runs.
2. `buildah bud --storage-driver vfs --isolation chroot` builds the Dockerfile on it. Inside the
   build, pip uses the host's effective pip configuration (`pip config list`: files and PIP_*
   variables, merged as pip merges them) and trusts the host's CA bundle: both are written to a
   directory mounted read-only at /run/cbserve-build, the CA beside the image's own CA file (a
   mount over /etc/ssl/certs/ca-certificates.crt would break the `ca-certificates` package), with
   the configuration's `cert` pointing at it. Local package sources the configuration names
   (find-links directories, file:// indexes, constraint files) are mounted read-only at the same
   paths, so `pip install torch==2.13.0` finds the same CPU build the host's pip does.

Everything lives in its own storage root (`--store`), so nothing touches the host's containers.
The last line printed is a JSON summary: the image, its size, and the seconds each stage took.
"""

from __future__ import annotations

import argparse
import ast
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_TAG = "localhost/cbserve-base:bookworm"
SUITE = "bookworm"
MOUNT_DIR = "/run/cbserve-build"          # where the build sees the pip configuration and CA
DEFAULT_CA = "/etc/ssl/certs/ca-certificates.crt"
PATH_KEYS = ("find-links", "constraint", "requirement", "client-cert")   # values that are local files
URL_KEYS = ("index-url", "extra-index-url")


def buildah(store: Path, *args: str, capture: bool = False) -> str:
    """Run buildah on the store's own vfs storage; raise with its output on failure."""
    cmd = ["buildah", "--root", str(store / "storage"), "--runroot", str(store / "run"),
           "--storage-driver", "vfs", *args]
    proc = subprocess.run(cmd, text=True, stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.PIPE if capture else None)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr or ''}")
    return proc.stdout or ""


# ------------------------------------------------------------------------------------------- base
def ensure_base(store: Path, mirror: str) -> float:
    """Import the debootstrapped Debian 12 as BASE_TAG unless it is there; returns the seconds spent."""
    start = time.monotonic()
    images = buildah(store, "images", "--format", "{{.Name}}:{{.Tag}}", capture=True).split()
    if BASE_TAG in images:
        return 0.0
    tarball = store / f"debian-{SUITE}-minbase.tar"
    if not tarball.is_file():
        with tempfile.TemporaryDirectory(dir=store) as tmp:
            rootfs = Path(tmp) / "rootfs"
            subprocess.run(["debootstrap", "--variant=minbase", SUITE, str(rootfs), mirror], check=True,
                           stdout=subprocess.DEVNULL)
            for deb in (rootfs / "var/cache/apt/archives").glob("*.deb"):
                deb.unlink()      # the image's apt fetches its own; cached debs are dead weight
            subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball) + ".tmp", "."], check=True)
            os.replace(str(tarball) + ".tmp", tarball)
    container = buildah(store, "from", "scratch", capture=True).strip()
    buildah(store, "add", container, str(tarball), "/", capture=True)
    buildah(store, "commit", "--rm", container, BASE_TAG, capture=True)
    return time.monotonic() - start


# ------------------------------------------------------------------------------------------- pip
def pip_settings(python: str) -> dict[str, dict[str, str]]:
    """The host's pip configuration as pip resolves it: {section: {key: value}}.

    `pip config list` prints every variant's values (files, then PIP_* variables as `:env:`);
    the variables win over every file section, as they do in pip's option parser."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], check=True, text=True,
                         capture_output=True).stdout
    sections: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        dotted, _, raw = line.partition("=")
        section, _, key = dotted.rpartition(".")
        if not key or not raw:
            continue
        sections.setdefault(section, {})[key] = ast.literal_eval(raw)
    env = sections.pop(":env:", {})
    sections.setdefault("global", {})
    for values in sections.values():
        values.update(env)
    return sections


def local_sources(settings: dict[str, dict[str, str]]) -> set[str]:
    """Host paths the configuration reads packages or constraints from (mounted at the same path)."""
    paths: set[str] = set()
    for values in settings.values():
        for key, value in values.items():
            for item in value.split():
                path = item[len("file://"):] if item.startswith("file://") else item
                if not path.startswith("/"):
                    continue
                if key in URL_KEYS:
                    # A local simple index links its files as ../../files/...: mount the index's parent.
                    path = str(Path(path).parent)
                if key in PATH_KEYS or key in URL_KEYS:
                    paths.add(path)
    return {p for p in paths if os.path.exists(p)}


def write_build_config(settings: dict[str, dict[str, str]], ca: str, dest: Path) -> None:
    """pip.conf for the build: the host's settings with `cert` pointing at the mounted CA copy."""
    lines = []
    for section, values in sorted(settings.items()):
        values = dict(values, cert=f"{MOUNT_DIR}/ca.crt")
        lines.append(f"[{section}]")
        lines += [f"{key} = {value}" for key, value in sorted(values.items())]
    (dest / "pip.conf").write_text("\n".join(lines) + "\n")
    shutil.copyfile(ca, dest / "ca.crt")


def host_ca(settings: dict[str, dict[str, str]]) -> str:
    """The CA bundle the host's pip trusts: its `cert`, else the system bundle."""
    ca = settings.get("global", {}).get("cert") or os.environ.get("SSL_CERT_FILE") or DEFAULT_CA
    if not os.path.isfile(ca):
        raise SystemExit(f"no CA bundle at {ca}: set pip's `cert` or SSL_CERT_FILE")
    return ca


# ------------------------------------------------------------------------------------------- build
def image_size(store: Path, tag: str) -> int:
    """Bytes of the image's layers, uncompressed (what it takes on a node)."""
    info = json.loads(buildah(store, "inspect", "--type", "image", tag, capture=True))
    # OCI config of a local vfs image: the manifest lists each layer's size as stored (uncompressed).
    return sum(layer["size"] for layer in info["OCIv1"]["rootfs"].get("layers_sizes", [])) or sum(
        layer["size"] for layer in json.loads(info["Manifest"])["layers"])


def build(store: Path, tag: str, python: str, context: Path) -> float:
    """`buildah bud` the Dockerfile on BASE_TAG with the host's pip setup; returns the seconds spent."""
    settings = pip_settings(python)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=store) as tmp:
        write_build_config(settings, host_ca(settings), Path(tmp))
        volumes = [f"{tmp}:{MOUNT_DIR}:ro"] + [f"{p}:{p}:ro" for p in sorted(local_sources(settings))]
        args = ["bud", "--isolation", "chroot", "--pull-never", "--layers=false",
                "--build-arg", f"BASE_IMAGE={BASE_TAG}",
                "--build-arg", f"PIP_CONFIG_FILE={MOUNT_DIR}/pip.conf", "-t", tag, "-f", "Dockerfile"]
        for volume in volumes:
            args += ["--volume", volume]
        buildah(store, *args, str(context))
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="localhost/cbserve:ci")
    parser.add_argument("--store", type=Path, default=ROOT / ".cache" / "image",
                        help="buildah storage root and the debootstrap cache")
    parser.add_argument("--python", default=sys.executable, help="interpreter whose pip configuration to use")
    parser.add_argument("--mirror", default=os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian"))
    args = parser.parse_args(argv)
    args.store = args.store.resolve()       # buildah takes volumes by absolute path only
    if os.geteuid() != 0:
        raise SystemExit("build_image.py runs as root (buildah chroot isolation, debootstrap)")
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            raise SystemExit(f"build_image.py needs {tool}: apt-get install -y buildah debootstrap")
    args.store.mkdir(parents=True, exist_ok=True)
    with open(args.store / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)      # two builds into one store would race on the base
        base_seconds = ensure_base(args.store, args.mirror)
        build_seconds = build(args.store, args.tag, args.python, ROOT)
    summary = {"image": args.tag, "size_bytes": image_size(args.store, args.tag),
               "base_seconds": round(base_seconds, 1), "build_seconds": round(build_seconds, 1)}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
