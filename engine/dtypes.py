"""Model dtype names (`--dtype`, `EngineConfig.dtype`, checkpoints' `torch_dtype`) and their torch
dtypes: one table below the engine, the tensor-parallel worker and the benchmarks alike."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
