"""`cbserve up` end to end: real router + prefill + decode processes with the tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from cbserve.cluster_spec import ClusterSpec
from cbserve.local_cluster import LocalCluster, free_ports

pytestmark = pytest.mark.slow


def test_local_cluster_serves_the_openai_client():
    spec = ClusterSpec(model="tiny", port=0, threads_per_pod=1, drain_seconds=5, startup_timeout=240)
    with LocalCluster(spec) as cluster:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=60)
        completion = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                               temperature=0.0, extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 8
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=6, stream=True, extra_body={"ignore_eos": True},
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == 6
        for pod in cluster.pods:   # every pod exports its metrics with its role
            page = httpx.get(pod.metrics_url, timeout=5, trust_env=False).text
            assert f'role="{pod.role}"' in page
        assert "cbserve_time_to_first_token_seconds" in httpx.get(cluster.metrics_url, timeout=5).text
        procs = cluster.processes
    assert all(p.returncode == 0 for p in procs.values()), {n: p.returncode for n, p in procs.items()}


def test_up_command_demo_then_ctrl_c_stops_everything():
    (port,) = free_ports(1)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "cbserve.cli", "up", "--port", str(port), "--demo",
                             "--threads-per-pod", "1", "--drain-seconds", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    out = []
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            out.append(line)
            if line.startswith("[demo] chat") or time.monotonic() > deadline:
                break
        text = "".join(out)
        assert "cbserve is ready" in text and f"http://127.0.0.1:{port}/v1" in text, text
        assert "prefill-0" in text and "decode-0" in text and "[demo] completion" in text, text
        pids = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                               text=True).stdout.split()]
        assert len(pids) == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        for pid in pids:   # the children are gone too, not orphaned
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
