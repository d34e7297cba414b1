"""`--speculative-config` (vLLM's flag and JSON keys) reaches the engine config from `generate`,
`prefill` and `decode`, is refused with the key named, and `cbserve up` hands it to the pods that
run decode steps (decode and colocated), not to prefill pods."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cbserve.cli import build_parser, engine_config_from_args
from cbserve.up import spec_from_args
from engine.spec_decode.config import SpeculativeConfig
from tests.pods.podproc import ROOT

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'


@pytest.mark.parametrize("command", ["generate", "prefill", "decode"])
def test_engine_commands_take_the_speculative_config(command):
    extra = ["--prompt", "hi"] if command == "generate" else []
    role = "colocated" if command == "generate" else command
    assert engine_config_from_args(build_parser().parse_args([command, *extra]), role).speculative is None
    args = build_parser().parse_args([command, *extra, "--speculative-config", NGRAM])
    assert engine_config_from_args(args, role).speculative == SpeculativeConfig("ngram", 4, 2, 5)


def test_a_bad_speculative_config_is_refused_naming_the_key(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'])
    assert "method 'eagle' needs model" in capsys.readouterr().err
    eagle = '{"method": "eagle", "model": "/heads/h", "num_speculative_tokens": 2}'
    args = build_parser().parse_args(["decode", "--tensor-parallel-size", "2", "--speculative-config", eagle])
    with pytest.raises(ValueError, match="'eagle' with --tensor-parallel-size 2"):   # before any model loads
        engine_config_from_args(args, "decode")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--speculative-config", '{"method": "ngram"}'])
    assert "num_speculative_tokens" in capsys.readouterr().err


def test_up_passes_it_to_decode_and_colocated_pods_only():
    spec = spec_from_args(build_parser().parse_args(["up", "--speculative-config", NGRAM]))
    for name, role in spec.pod_roles():
        argv = spec.pod_argv(name, role, 1, 2, 3)
        if role == "prefill":     # it runs the one KV group its speculating decode pods run
            assert "--speculative-config" not in argv
            assert argv[argv.index("--kv-cache-groups") + 1] == "single"
            build_parser().parse_args(argv)                  # a command `cbserve prefill` takes
        else:
            assert SpeculativeConfig.from_json(argv[argv.index("--speculative-config") + 1]) == \
                SpeculativeConfig.from_json(NGRAM)
    colocated = spec_from_args(build_parser().parse_args(["up", "--colocated", "1", "--speculative-config", NGRAM]))
    assert all("--speculative-config" in colocated.pod_argv(n, r, 1, 2, 3) for n, r in colocated.pod_roles())
    plain = spec_from_args(build_parser().parse_args(["up"]))
    assert not any("--speculative-config" in plain.pod_argv(n, r, 1, 2, 3) or
                   "--kv-cache-groups" in plain.pod_argv(n, r, 1, 2, 3) for n, r in plain.pod_roles())


def test_generate_with_speculation_prints_the_plain_text():
    base = [sys.executable, "-m", "cbserve.cli", "--log-level", "WARNING", "generate", "--prompt", "hello there",
            "--max-tokens", "12", "--num-blocks", "64"]
    env = {"CBSERVE_NUM_THREADS": "1"}
    import os
    env = {**os.environ, **env}
    plain = subprocess.run(base, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    spec = subprocess.run(base + ["--speculative-config", '{"method": "draft_model", "model": "tiny", '
                                  '"num_speculative_tokens": 3}'], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    bad = subprocess.run(base + ["--speculative-config", '{"method": "draft_model", "model": "/nonexistent", '
                                 '"num_speculative_tokens": 3}'], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "speculative model" in bad.stderr
