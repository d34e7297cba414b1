"""Regenerate the committed wire modules: `python proto/generate.py [OUT_DIR]`.

The generated files live in `wire/` (not in a top-level package named `proto`, which is the
import name of the `proto-plus` library). `tests/test_proto_current.py` fails when they are stale.
"""

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent


def generate(out_dir: Path) -> None:
    sources = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *[str(ROOT / s) for s in sources]]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT.parent)
