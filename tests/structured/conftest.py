"""One real cluster (1 prefill + 1 decode pod, tiny random weights, tool markers as special
tokens) for the whole folder, and routers over it built per test module: each router is the real
app in this process (its own thread and event loop) with its own chat template and flags,
disaggregated or colocated (the decode pod prefilling itself, the colocated path)."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "router"))

from cbserve.cluster_spec import ClusterSpec  # noqa: E402
from cbserve.local_cluster import LocalCluster  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from model_dirs import pod_model_dir, router_model_dir  # noqa: E402
from pod.security import ClusterSecurity  # noqa: E402
from router.app import create_app  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router_harness import LoopThread, serve_app  # noqa: E402


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("structured-models")


@pytest.fixture(scope="session")
def pod_dir(model_root) -> Path:
    return pod_model_dir(model_root)


@pytest.fixture(scope="session")
def cluster(pod_dir):
    spec = ClusterSpec(model=str(pod_dir), port=0, threads_per_pod=1, drain_seconds=2, startup_timeout=300,
                       max_num_seqs=32)
    with LocalCluster(spec) as c:
        yield c


class Routers:
    """Starts routers over the cluster's pods; stops them all at the end."""

    def __init__(self, cluster, model_root: Path, pod_dir: Path) -> None:
        self._cluster, self._root, self._pod_dir = cluster, model_root, pod_dir
        self._stack = contextlib.ExitStack()

    def start(self, name: str, template: str, *, colocated: bool = False, **config) -> "Router":
        model = router_model_dir(self._root, self._pod_dir, name, template)
        addresses = {pod.role: pod.address for pod in self._cluster.pods}
        roles = {"colocated": (addresses["decode"],)} if colocated else {
            "prefill": (addresses["prefill"],), "decode": (addresses["decode"],)}
        # SLOs no loaded CPU misses: admission never turns a test's burst away.
        app = create_app(RouterConfig(model=str(model), served_model_name="tiny", api_key_env=None, max_retries=0,
                                      security=ClusterSecurity(secret=self._cluster.cluster_secret),
                                      slo_ttft_ms=600_000, slo_tpot_ms=600_000, max_queue_seconds=300,
                                      **roles, **config))
        thread = self._stack.enter_context(LoopThread(lambda: serve_app(app)))
        deadline = time.monotonic() + 30
        while httpx.get(thread.value + "/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the router found no routable pod"
            time.sleep(0.05)
        return Router(thread.value, Tokenizer.from_pretrained(model))

    def close(self) -> None:
        self._stack.close()


class Router:
    def __init__(self, url: str, tokenizer: Tokenizer) -> None:
        self.url = url
        self.tokenizer = tokenizer
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def routers(cluster, model_root, pod_dir):
    started = Routers(cluster, model_root, pod_dir)
    yield started
    started.close()
