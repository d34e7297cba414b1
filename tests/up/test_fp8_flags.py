"""`--quantization fp8` and `--kv-cache-dtype` reach the engine config, and `cbserve up` hands them
to every pod."""

from __future__ import annotations

import pytest

from cbserve.cli import build_parser, engine_config_from_args
from cbserve.up import spec_from_args


@pytest.mark.parametrize("command", ["generate", "prefill", "decode"])
def test_engine_commands_take_fp8_flags(command):
    extra = ["--prompt", "hi"] if command == "generate" else []
    role = "colocated" if command == "generate" else command
    config = engine_config_from_args(build_parser().parse_args([command, *extra]), role)
    assert (config.quantization, config.cache.kv_cache_dtype) == (None, "auto")
    args = build_parser().parse_args([command, *extra, "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    config = engine_config_from_args(args, role)
    assert (config.quantization, config.cache.kv_cache_dtype) == ("fp8", "fp8")
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, *extra, "--kv-cache-dtype", "int4"])


def test_up_passes_fp8_flags_to_every_pod():
    args = build_parser().parse_args(["up", "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    spec = spec_from_args(args)
    for name, role in spec.pod_roles():
        argv = spec.pod_argv(name, role, 1, 2, 3)
        assert argv[argv.index("--quantization") + 1] == "fp8"
        assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    plain = spec_from_args(build_parser().parse_args(["up"]))
    assert not any("--kv-cache-dtype" in plain.pod_argv(n, r, 1, 2, 3) for n, r in plain.pod_roles())
