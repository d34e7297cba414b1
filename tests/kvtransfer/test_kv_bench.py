"""bench/kv_transfer.py runs end to end on a tiny prompt and reports every number."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_json_has_every_measurement():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kv_transfer.py"), "--shapes", "tiny",
         "--prompt-tokens", "64", "--chunk-tokens", "32", "--prefill-chunk-ms", "5",
         "--repeats", "1", "--json"],
        capture_output=True, text=True, timeout=170, check=True)
    report = json.loads(out.stdout)
    (row,) = report["rows"]
    assert row["shape"] == "tiny" and row["mib"] == 64 * 4 * 2 * 2 * 64 * 4 / 2**20
    for key in ("copy_gbps", "grpc_gbps", "gloo_gbps", "exposed_s", "exposed_ratio"):
        assert row[key] > 0, key
    assert report["checksum_gbps"]["zlib.crc32"] > 0
