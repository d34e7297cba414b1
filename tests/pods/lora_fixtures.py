"""PEFT adapters of the `tiny` preset for pod and cluster tests, in one directory (the pods'
`--lora-root`), and the flags that serve them."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from engine.presets import resolve_model_dir
from tests.engine.lora_adapters import make_adapter

# name -> make_adapter options (ranks under --max-lora-rank 16)
TINY_ADAPTERS = {
    "sql": dict(r=8, alpha=16, seed=11),
    "chat": dict(r=16, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"), use_rslora=True, seed=12),
    "extra": dict(r=4, alpha=8, targets=("v_proj", "down_proj"), seed=13),   # loaded at run time
}


def tiny_adapters(root: Path) -> dict[str, Path]:
    """Write every adapter of `TINY_ADAPTERS` under `root`; returns name -> directory."""
    base = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_dir("tiny"), dtype=torch.float32).eval()
    return {name: make_adapter(base, root / name, **opts) for name, opts in TINY_ADAPTERS.items()}


def lora_pod_args(adapters: dict[str, Path], root: Path, startup=("sql", "chat"), max_loras: int = 2,
                  max_cpu_loras: int | None = None) -> list[str]:
    """Pod flags serving `startup` adapters, runtime loading allowed under `root`."""
    args = ["--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", "16",
            "--allow-runtime-lora-updating", "--lora-root", str(root)]
    if max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(max_cpu_loras)]
    if startup:
        args += ["--lora-modules", *(f"{name}={adapters[name]}" for name in startup)]
    return args
