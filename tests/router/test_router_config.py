"""RouterConfig and the `cbserve router` flags of the CLI contract."""

from __future__ import annotations

import argparse

import pytest

from pod.auth import SECRET_ENV
from router.config import RouterConfig
from router.flags import add_router_arguments, router_config_from_args


@pytest.fixture(autouse=True)
def cluster_secret(monkeypatch):
    """The router refuses to start without the deployment secret; these command lines have one."""
    monkeypatch.setenv(SECRET_ENV, "router-config-test-secret")


def _parse(argv: str) -> RouterConfig:
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    return router_config_from_args(parser.parse_args(argv.split()))


def test_contract_static_command_line():
    config = _parse("--model tiny --host 0.0.0.0 --port 8000 --prefill 10.0.0.1:50051,10.0.0.2:50051 "
                    "--decode 10.0.1.1:50052 --policy goodput --slo-ttft-ms 500 --slo-tpot-ms 50 "
                    "--admission queue --max-queue-seconds 5 --api-key-env CBSERVE_API_KEY --drain-seconds 30")
    assert config.prefill == ("10.0.0.1:50051", "10.0.0.2:50051") and config.decode == ("10.0.1.1:50052",)
    assert (config.policy, config.slo_ttft_ms, config.slo_tpot_ms) == ("goodput", 500, 50)
    assert (config.admission, config.max_queue_seconds, config.drain_seconds) == ("queue", 5, 30)
    assert config.model_name == "tiny" and config.disaggregated


def test_contract_kubernetes_and_colocated_command_lines():
    config = _parse("--model tiny --discovery kubernetes --namespace serving --prefill-service p "
                    "--decode-service d --grpc-port-name grpc --policy least_loaded --admission reject")
    assert (config.discovery, config.namespace, config.prefill_service, config.decode_service) == (
        "kubernetes", "serving", "p", "d")
    colocated = _parse("--colocated 127.0.0.1:50052 --policy round_robin")
    assert colocated.colocated == ("127.0.0.1:50052",) and not colocated.disaggregated


def test_trust_flags(monkeypatch, tmp_path):
    assert _parse("--colocated a:1").security.secret == "router-config-test-secret"
    path = tmp_path / "secret"
    path.write_text("from-a-mounted-file-0123\n")
    config = _parse(f"--colocated a:1 --cluster-secret-file {path} --tls-ca {path} --tls-server-name pods")
    assert config.security.secret == "from-a-mounted-file-0123" and config.security.client_tls
    assert config.security.tls_server_name == "pods"
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ValueError, match="no cluster secret"):
        _parse("--colocated a:1")
    assert _parse("--colocated a:1 --insecure-no-cluster-secret").security.secret is None


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("MY_KEY", "k1")
    assert RouterConfig(api_key_env="MY_KEY").resolved_api_key() == "k1"
    monkeypatch.setenv("MY_KEY", "")
    assert RouterConfig(api_key_env="MY_KEY").resolved_api_key() is None
    assert RouterConfig(api_key="direct", api_key_env="MY_KEY").resolved_api_key() == "direct"


def test_api_key_flags_file_and_environment(tmp_path, monkeypatch):
    """`--api-key` beats `--api-key-file` beats the variable (issue 11, case 10: there was no flag)."""
    monkeypatch.setenv("CBSERVE_API_KEY", "from-env")
    pods = "--colocated 127.0.0.1:50052"
    assert _parse(pods).resolved_api_key() == "from-env"
    flag = _parse(f"{pods} --api-key from-flag")
    assert flag.resolved_api_key() == "from-flag" and "from-flag" not in repr(flag)
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert _parse(f"{pods} --api-key-file {key_file}").resolved_api_key() == "from-file"
    with pytest.raises(SystemExit):                      # one or the other, not both
        _parse(f"{pods} --api-key a --api-key-file {key_file}")
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        _parse(f"{pods} --api-key-file {key_file}")
    with pytest.raises(ValueError, match="cannot read"):
        _parse(f"{pods} --api-key-file {tmp_path / 'missing'}")


def test_max_request_body_bytes_flag():
    assert _parse("--colocated 127.0.0.1:50052").max_request_body_bytes == 16 << 20
    assert _parse("--colocated 127.0.0.1:50052 --max-request-body-bytes 4096").max_request_body_bytes == 4096
    with pytest.raises(ValueError, match="max_request_body_bytes"):
        RouterConfig(max_request_body_bytes=10)


@pytest.mark.parametrize("kwargs,message", [
    ({"prefill": ("a:1",), "decode": ()}, "must both be given"),
    ({"colocated": ("a:1",), "prefill": ("b:2",), "decode": ("c:3",)}, "either --colocated"),
    ({"prefill": ("nohost",), "decode": ("c:3",)}, "HOST:PORT"),
    ({"policy": "fastest"}, "policy"),
    ({"admission": "maybe"}, "admission"),
    ({"slo_ttft_ms": 0}, "slo_ttft_ms"),
    ({"load_interval_seconds": 0.5}, "0.1"),
    ({"kv_transport": "rdma"}, "kv_transport"),
])
def test_invalid_configs_fail_loudly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kwargs)


def test_static_router_without_pods_is_an_error():
    with pytest.raises(ValueError, match="--colocated"):
        _parse("--model tiny")


def test_tool_and_reasoning_flags():
    config = _parse("--colocated a:1 --tool-call-parser mistral --enable-auto-tool-choice --reasoning-parser "
                    "deepseek_r1 --exclude-tools-when-tool-choice-none --max-schema-bytes 2048 "
                    "--max-schema-depth 4 --max-tools 8")
    assert (config.tool_call_parser, config.enable_auto_tool_choice, config.reasoning_parser) == (
        "mistral", True, "deepseek_r1")
    assert config.exclude_tools_when_tool_choice_none
    assert (config.max_schema_bytes, config.max_schema_depth, config.max_tools) == (2048, 4, 8)
    defaults = _parse("--colocated a:1")
    assert defaults.tool_call_parser is None and not defaults.enable_auto_tool_choice and defaults.max_tools == 128
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        _parse("--colocated a:1 --enable-auto-tool-choice")
    with pytest.raises(ValueError, match="max_tools"):
        RouterConfig(colocated=("a:1",), max_tools=0)
    with pytest.raises(ValueError, match="tool_call_parser"):
        RouterConfig(colocated=("a:1",), tool_call_parser="pythonic")


def test_up_passes_the_tool_flags_to_its_router():
    from cbserve.up import add_up_command, spec_from_args

    parser = argparse.ArgumentParser()
    add_up_command(parser.add_subparsers())
    spec = spec_from_args(parser.parse_args(["up", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                                             "--reasoning-parser", "qwen3"]))
    argv = spec.router_argv(8000, {"prefill": ["p:1"], "decode": ["d:1"], "colocated": []})
    assert argv[-5:] == ["--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3"]
