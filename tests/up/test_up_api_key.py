"""`cbserve up --api-key / --api-key-file`: the key reaches the ClusterSpec (and so only the router)."""

from __future__ import annotations

import pytest

from cbserve.cli import build_parser
from cbserve.up import spec_from_args


def _spec(argv: list[str]):
    return spec_from_args(build_parser().parse_args(["up", *argv]))


def test_api_key_flag_and_file(tmp_path):
    assert _spec([]).api_key is None                    # the router falls back to CBSERVE_API_KEY
    assert _spec(["--api-key", "k1"]).api_key == "k1"
    key_file = tmp_path / "key"
    key_file.write_text("k2\n")
    assert _spec(["--api-key-file", str(key_file)]).api_key == "k2"
    key_file.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        _spec(["--api-key-file", str(key_file)])
    with pytest.raises(SystemExit):
        _spec(["--api-key", "a", "--api-key-file", str(key_file)])
