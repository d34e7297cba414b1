"""`--tensor-parallel-size` from the command line to each engine: every engine command takes it,
`cbserve up` passes it to every pod (the prefill pods may take another degree), and bad values
are usage errors."""

from __future__ import annotations

import pytest

from cbserve.cli import build_parser, engine_config_from_args
from cbserve.cluster_spec import ClusterSpec
from cbserve.up import spec_from_args


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.mark.parametrize("command", ["generate", "prefill", "decode"])
def test_engine_commands_take_the_flag(command):
    extra = ["--prompt", "hi"] if command == "generate" else []
    role = "colocated" if command == "generate" else command
    assert engine_config_from_args(build_parser().parse_args([command, *extra]), role).tensor_parallel_size == 1
    args = build_parser().parse_args([command, *extra, "--tensor-parallel-size", "4"])
    assert engine_config_from_args(args, role).tensor_parallel_size == 4


def test_zero_ranks_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--tensor-parallel-size", "0"])
    assert "must be >= 1" in capsys.readouterr().err


def test_up_gives_each_pool_its_degree():
    spec = spec_from_args(build_parser().parse_args(
        ["up", "--tensor-parallel-size", "2", "--prefill-tensor-parallel-size", "4"]))
    argv = {role: spec.pod_argv(name, role, 1, 2, 3) for name, role in spec.pod_roles()}
    assert _flag(argv["prefill"], "--tensor-parallel-size") == "4"
    assert _flag(argv["decode"], "--tensor-parallel-size") == "2"
    plain = ClusterSpec()
    assert not any("--tensor-parallel-size" in plain.pod_argv(n, r, 1, 2, 3) for n, r in plain.pod_roles())
    colocated = ClusterSpec(num_colocated=1, tensor_parallel_size=2)
    assert _flag(colocated.pod_argv("colocated-0", "colocated", 1, 2, 3), "--tensor-parallel-size") == "2"


def test_up_refuses_tensor_parallel_pods_on_the_nccl_transport():
    with pytest.raises(ValueError, match="grpc only"):
        ClusterSpec(tensor_parallel_size=2, kv_transport="nccl")
