"""The Dockerfile builds and the image serves, with no container daemon and no registry.

`.ci/build_image.py` builds the image on a debootstrapped Debian 12 (buildah, vfs storage, chroot
isolation, the host's pip configuration and CA mounted read-only). The tests then run the image
as the chart does, through `buildah run` with chroot isolation: processes inside the image's
root filesystem, as uid 10001, sharing the host's network namespace, so a client on the host
reaches them over loopback.

Needs root, buildah and debootstrap; without them the tests skip, unless
CBSERVE_REQUIRE_IMAGE_TEST=1 (as `.ci/run` sets), which turns the skip into a failure.
With CBSERVE_IMAGE_BUILDING=1 the tests use the build `.ci/run` started in the background before
the suite (in the store; `build.rc` holds its exit status when it ends) instead of building.
Set CBSERVE_IMAGE_STORE to reuse a buildah store (and its debootstrap cache) between runs, and
CBSERVE_IMAGE_REUSE=1 to run the image already in it instead of building (when iterating on these
tests; CI always builds).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from cbserve.local_cluster import free_ports
from tests.process_leaks import SESSION_ENV, marked, stop

ROOT = Path(__file__).resolve().parents[2]
TAG = "localhost/cbserve:ci"
BUILD_TIMEOUT_S = 2400          # a cold build on 2 busy cores: debootstrap, two apt stages, torch
READY_TIMEOUT_S = 600           # three engines loading torch at once on a loaded machine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT_S + READY_TIMEOUT_S)]
# Marks every process this module starts inside the image (see `Buildah.run_args`).
RUN_ENV = "CBSERVE_IMAGE_TEST_RUN"
RUN_ID = secrets.token_hex(8)


def stop_container_processes() -> None:
    """Stop whatever still runs inside the image, and fail if anything needed more than SIGTERM.

    `buildah run` (chroot isolation) runs the command as the last of a chain of its own
    processes, each relaying stdio for the next. SIGTERM to buildah's process group makes buildah
    exit, the chain goes with it and takes the image's tini down without tini passing the signal
    on: the cbserve process under it is reparented to init. So the router, which rarely writes to
    its stdout, kept running as uid 10001 after CI (the pods, which log often, died of the broken
    pipe). The container's processes are found by their mark and signalled directly instead."""
    stubborn = stop(RUN_ENV, RUN_ID, grace_seconds=30.0)
    assert not stubborn, f"needed SIGKILL after 30 s: {[str(p) for p in stubborn]}"
    left = marked(RUN_ENV, RUN_ID)
    assert not left, f"still running: {[str(p) for p in left]}"


def _unavailable(reason: str) -> None:
    if os.environ.get("CBSERVE_REQUIRE_IMAGE_TEST") == "1":
        pytest.fail(f"CBSERVE_REQUIRE_IMAGE_TEST=1 but {reason}")
    pytest.skip(reason)


class Buildah:
    """buildah on the test's own vfs store (the one build_image.py filled)."""

    def __init__(self, store: Path) -> None:
        self.base = ["buildah", "--root", str(store / "storage"), "--runroot", str(store / "run"),
                     "--storage-driver", "vfs"]

    def __call__(self, *args: str, timeout: float = 600) -> str:
        proc = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"buildah {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def run_args(self, container: str, user: str, command: list[str], env: dict[str, str] | None = None) -> list[str]:
        """argv that runs `command` in `container` as `user` on the host network, as a pod would.

        The processes inside get a hand-made environment: it carries the session's leak mark
        (tests/process_leaks.py) and `RUN_ENV`, by which teardown finds them wherever they run."""
        env = {SESSION_ENV: os.environ.get(SESSION_ENV, ""), RUN_ENV: RUN_ID, **(env or {})}
        extra = [arg for key, value in env.items() for arg in ("--env", f"{key}={value}")]
        return [*self.base, "run", "--isolation", "chroot", "--network", "host", "--user", user,
                "--env", "OMP_NUM_THREADS=1", *extra, container, "--", *command]


def _wait_for_started_build(store: Path) -> int:
    """The exit status of the build `.ci/run` started before the suite (CBSERVE_IMAGE_BUILDING=1):
    it writes `build.log` and, when it ends, `build.rc` in the store. Started first, it overlaps
    the rest of the suite, and this module runs last (tests/conftest.py)."""
    rc = store / "build.rc"
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while not rc.is_file():
        assert time.monotonic() < deadline, f"the build .ci/run started wrote no {rc} in {BUILD_TIMEOUT_S} s"
        time.sleep(2)
    return int(rc.read_text().strip() or 1)


@pytest.fixture(scope="module")
def built() -> tuple[Buildah, dict]:
    """Build the image (or fail with the build log's tail); returns the store and the build summary."""
    if os.geteuid() != 0:
        _unavailable("building with buildah's chroot isolation needs root")
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            _unavailable(f"{tool} is not installed (apt-get install -y buildah debootstrap)")
    store = Path(os.environ.get("CBSERVE_IMAGE_STORE", ROOT / ".cache" / "image"))
    store.mkdir(parents=True, exist_ok=True)
    if os.environ.get("CBSERVE_IMAGE_REUSE") == "1" and (store / "last_build.json").is_file():
        return Buildah(store), json.loads((store / "last_build.json").read_text())
    log = store / "build.log"
    if os.environ.get("CBSERVE_IMAGE_BUILDING") == "1":
        returncode = _wait_for_started_build(store)
    else:
        with log.open("w") as out:
            returncode = subprocess.run([sys.executable, str(ROOT / ".ci" / "build_image.py"), "--store", str(store),
                                         "--tag", TAG], stdout=out, stderr=subprocess.STDOUT,
                                        timeout=BUILD_TIMEOUT_S).returncode
    text = log.read_text()
    assert returncode == 0, f"image build failed; last lines of {log}:\n{text[-4000:]}"
    summary = json.loads(text.strip().splitlines()[-1])
    (store / "last_build.json").write_text(json.dumps(summary) + "\n")
    print(f"\nimage build: {summary}", file=sys.stderr)
    return Buildah(store), summary


@pytest.fixture(scope="module")
def container(built):
    buildah, _ = built
    name = buildah("from", "--pull-never", "--name", f"cbserve-test-{os.getpid()}", TAG).strip()
    yield name
    buildah("rm", name)


@pytest.fixture(scope="module")
def config(built) -> dict:
    buildah, _ = built
    return json.loads(buildah("inspect", "--type", "image", TAG))["OCIv1"]["config"]


def test_image_runs_cbserve_through_tini_as_the_charts_user(config):
    assert config["Entrypoint"] == ["/usr/bin/tini", "--", "cbserve"]
    assert config["User"] == "10001:10001"
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["CBSERVE_CACHE_DIR"] == "/var/cache/cbserve"


def test_generate_on_the_tiny_preset_as_uid_10001(built, container, config):
    buildah, _ = built
    # Exactly what the container runtime would exec: the entrypoint plus the chart's arguments.
    argv = [*config["Entrypoint"], "generate", "--model", "tiny", "--prompt", "Hello", "--max-tokens", "8"]
    try:
        proc = subprocess.run(buildah.run_args(container, config["User"], ["sh", "-c", 'id -u; exec "$@"', "sh", *argv]),
                              capture_output=True, text=True, timeout=READY_TIMEOUT_S)
    finally:
        stop_container_processes()   # on a timeout, subprocess.run killed buildah only
    assert proc.returncode == 0, proc.stderr[-3000:]
    uid, _, text = proc.stdout.partition("\n")
    assert uid == "10001"
    assert text.strip(), f"no generated text; stderr: {proc.stderr[-2000:]}"


def _wait_ready(url: str, procs: dict[str, subprocess.Popen], logs: dict[str, Path]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited with {proc.returncode}: {logs[name].read_text()[-3000:]}"
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    pytest.fail(f"router at {url} not ready within {READY_TIMEOUT_S}s")


def test_router_prefill_and_decode_from_the_image_answer_over_loopback(built, container, config, tmp_path):
    buildah, _ = built
    prefill_port, prefill_metrics, decode_port, decode_metrics, http_port = free_ports(5)
    entry = config["Entrypoint"]
    commands = {
        "prefill": [*entry, "prefill", "--model", "tiny", "--host", "127.0.0.1", "--port", str(prefill_port),
                    "--metrics-port", str(prefill_metrics), "--num-blocks", "256", "--drain-seconds", "5"],
        "decode": [*entry, "decode", "--model", "tiny", "--host", "127.0.0.1", "--port", str(decode_port),
                   "--metrics-port", str(decode_metrics), "--num-blocks", "256", "--drain-seconds", "5"],
        "router": [*entry, "router", "--model", "tiny", "--host", "127.0.0.1", "--port", str(http_port),
                   "--prefill", f"127.0.0.1:{prefill_port}", "--decode", f"127.0.0.1:{decode_port}",
                   "--drain-seconds", "5"],
    }
    # The router and the pods share one deployment secret (the chart mounts it as a file).
    secret = {"CBSERVE_CLUSTER_SECRET": secrets.token_urlsafe(24)}
    procs: dict[str, subprocess.Popen] = {}
    # Logs go to files: a pipe nobody reads until the end fills up and blocks a chatty pod.
    logs = {name: tmp_path / f"{name}.log" for name in commands}
    try:
        for name, argv in commands.items():
            with logs[name].open("w") as log:
                procs[name] = subprocess.Popen(buildah.run_args(container, config["User"], argv, secret),
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{http_port}"
        _wait_ready(url, procs, logs)
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, stream=True)
        pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
        assert len(pieces) >= 2 and "".join(pieces)
        # Requests go P -> D: the decode pod pulls their KV from the prefill pod (a pull ends before
        # D's first token, so the counter is final once the stream is). Right after /ready the
        # router may still pass over a prefill pod whose first load reports it has not read (the
        # decode pod then prefills locally: served, but no pull), so a few more requests may be
        # needed before one shows the pull.
        for attempt in range(6):
            if attempt:
                time.sleep(1)
                client.completions.create(model="tiny", prompt="Hello again", max_tokens=4, temperature=0)
            metrics = httpx.get(f"http://127.0.0.1:{decode_metrics}/metrics", timeout=10).text
            (kv_bytes,) = [float(line.split()[-1]) for line in metrics.splitlines()
                           if line.startswith('cbserve_kv_transfer_bytes_total{role="decode"}')]
            if kv_bytes > 0:
                break
        assert kv_bytes > 0, metrics
    finally:
        # Everything inside the image, by its mark; each `buildah run` exits once its command has.
        stop_container_processes()
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
