"""`--gpu-memory-utilization` from the command line to each pod: the per-device split of `cbserve up`,
the flags every engine command takes, and pods sharing a CUDA device starting one at a time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cbserve.cli import build_parser, engine_config_from_args
from cbserve.cluster_spec import ClusterSpec, gpu_memory_shares
from cbserve.local_cluster import LocalCluster
from cbserve.up import spec_from_args

FAKE = [sys.executable, str(Path(__file__).with_name("fake_child.py"))]


@pytest.mark.parametrize("devices, utilization, shares", [
    (["cuda", "cuda"], None, [0.45, 0.45]),                     # 1 prefill + 1 decode, default 0.9
    (["cuda"], None, [0.9]),
    (["cuda", "cuda", "cuda"], 0.6, [0.2, 0.2, 0.2]),
    (["cuda", "cuda", "cuda"], 0.9, [0.3, 0.3, 0.3]),           # not 0.30000000000000004
    (["cuda:0"] * 7, 0.9, [0.1285] * 7),                        # rounded down: 7 x 0.1285 <= 0.9
    (["cuda", "cuda:0", "cuda:1"], 0.8, [0.4, 0.4, 0.8]),       # cuda is cuda:0
    (["cpu", "cpu"], 0.5, [None, None]),                        # unused on CPU
    (["cpu", "cuda:1"], None, [None, 0.9]),
])
def test_each_pod_gets_an_even_part_of_its_device(devices, utilization, shares):
    assert gpu_memory_shares(devices, utilization) == shares
    for device in set(devices):
        parts = [s for d, s in zip(devices, shares) if d == device and s is not None]
        assert sum(parts) <= (utilization or 0.9) + 1e-12


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.mark.parametrize("spec, share", [
    (ClusterSpec(device="cuda"), "0.45"),
    (ClusterSpec(device="cuda", num_prefill=2, num_decode=1, gpu_memory_utilization=0.6), "0.2"),
    (ClusterSpec(device="cuda:1", num_colocated=1), "0.9"),
    (ClusterSpec(device="cuda", num_blocks=1024), None),       # an explicit size: nothing to split
    (ClusterSpec(device="cpu", gpu_memory_utilization=0.5), None),
    (ClusterSpec(), None),                                      # pods default to CPU
])
def test_every_pod_command_carries_its_share(spec, share):
    for name, role in spec.pod_roles():
        argv = spec.pod_argv(name, role, 1, 2, 3)
        assert _flag(argv, "--gpu-memory-utilization") == share


def test_spec_checks_the_share():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        ClusterSpec(gpu_memory_utilization=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        ClusterSpec(gpu_memory_utilization=1.5)


@pytest.mark.parametrize("command", ["generate", "prefill", "decode"])
def test_engine_commands_take_the_flag_and_default_to_derived_sizes(command):
    extra = ["--prompt", "hi"] if command == "generate" else []
    role = "colocated" if command == "generate" else command
    cache = engine_config_from_args(build_parser().parse_args([command, *extra]), role).cache
    assert (cache.gpu_memory_utilization, cache.kv_cache_memory_bytes, cache.num_blocks) == (None, None, None)
    args = build_parser().parse_args([command, *extra, "--gpu-memory-utilization", "0.45",
                                      "--kv-cache-memory-mb", "64"])
    cache = engine_config_from_args(args, role).cache
    assert (cache.gpu_memory_utilization, cache.kv_cache_memory_bytes) == (0.45, 64 << 20)


@pytest.mark.parametrize("value", ["0", "1.2", "-0.1"])
def test_out_of_range_flag_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["decode", "--gpu-memory-utilization", value])
    assert exit_info.value.code == 2 and "--gpu-memory-utilization" in capsys.readouterr().err


def test_up_passes_the_device_share_to_the_spec():
    spec = spec_from_args(build_parser().parse_args(["up", "--device", "cuda", "--gpu-memory-utilization", "0.8"]))
    assert spec.gpu_memory_utilization == 0.8 and spec.pod_gpu_memory_utilization() == 0.4
    assert spec_from_args(build_parser().parse_args(["up"])).gpu_memory_utilization is None


def test_pods_sharing_a_cuda_device_start_one_after_another(tmp_path, monkeypatch):
    """Stand-in children (no GPU needed): each pod is SERVING before the next one starts."""
    monkeypatch.setenv("FAKE_RECORD_DIR", str(tmp_path))
    monkeypatch.setenv("FAKE_READY_DELAY", "0.3")
    lines: list[str] = []
    spec = ClusterSpec(device="cuda", num_prefill=1, num_decode=2, port=0, drain_seconds=1)
    assert spec.shares_cuda_device and not ClusterSpec(device="cpu").shares_cuda_device
    with LocalCluster(spec, sink=lines.append, command=FAKE):
        pass
    order = [line for line in lines if line.endswith((" starting", " ready")) and "router" not in line]
    assert order == ["[prefill-0] prefill-0 starting", "[prefill-0] prefill-0 ready",
                     "[decode-0] decode-0 starting", "[decode-0] decode-0 ready",
                     "[decode-1] decode-1 starting", "[decode-1] decode-1 ready"]
    argv = json.loads((tmp_path / "decode-1.json").read_text())["argv"]
    assert _flag(argv, "--gpu-memory-utilization") == "0.3"


@pytest.mark.parametrize("command", ["generate", "prefill", "decode"])
def test_engine_commands_take_enforce_eager_and_no_async_scheduling(command):
    extra = ["--prompt", "hi"] if command == "generate" else []
    role = "colocated" if command == "generate" else command
    config = engine_config_from_args(build_parser().parse_args([command, *extra]), role)
    assert (config.enforce_eager, config.async_scheduling) == (False, None)   # CUDA: graphs, overlap
    args = build_parser().parse_args([command, *extra, "--enforce-eager", "--no-async-scheduling"])
    config = engine_config_from_args(args, role)
    assert (config.enforce_eager, config.async_scheduling) == (True, False)


def test_up_passes_enforce_eager_to_every_pod():
    spec = ClusterSpec(device="cuda", enforce_eager=True)
    assert all("--enforce-eager" in spec.pod_argv(name, role, 1, 2, 3) for name, role in spec.pod_roles())
    assert not any("--enforce-eager" in ClusterSpec().pod_argv(n, r, 1, 2, 3) for n, r in ClusterSpec().pod_roles())
