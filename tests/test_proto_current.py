"""The committed wire modules are what `proto/generate.py` makes from the .proto today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_modules_are_current(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), str(tmp_path)], check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = ROOT / rel
        assert committed.is_file(), f"{rel} is generated but not committed"
        assert committed.read_text() == (tmp_path / rel).read_text(), \
            f"{rel} is stale: run `python proto/generate.py` and commit the result"


def test_wire_modules_import_without_torch():
    code = "import sys, wire.cbserve_pb2_grpc; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
