"""bench/gpu_check.sh's first section: every import a later section needs, in seconds, not minutes in.

A missing or too old package (the router's fastapi and uvicorn, the pods' grpc_health, the
protobuf and grpcio that `wire/` was generated for, triton) would otherwise surface as a
collection error or a pod that never starts, deep into a section's time. Prints one line per
import and exits 1 if any failed; `--cpu`: no CUDA device is expected (the smoke run).

    python -m bench.gpu_preflight
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

IMPORTS = ["wire.cbserve_pb2", "wire.cbserve_pb2_grpc", "fastapi", "uvicorn", "pydantic", "grpc",
           "grpc_health.v1.health", "google.protobuf", "triton", "torch", "transformers"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="do not require a CUDA device")
    args = ap.parse_args(argv)
    failed = []
    for name in IMPORTS:
        start = time.perf_counter()
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - report every failure, then fail once
            failed.append(name)
            print(f"FAILED import {name}: {type(e).__name__}: {e}", flush=True)
            continue
        print(f"ok {name} {getattr(module, '__version__', '')} ({time.perf_counter() - start:.1f} s)", flush=True)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        failed.append("cuda")
        print("FAILED cuda: torch.cuda.is_available() is False", flush=True)
    print(f"preflight: {len(IMPORTS) - len(failed)} of {len(IMPORTS)} imports ok" +
          (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
