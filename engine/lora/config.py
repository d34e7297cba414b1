"""`LoRAConfig`: the engine's adapter settings, with vLLM's flag names; torch-free.

`max_loras` adapters can be in one batch: each has a device *slot* (`max_loras` x `max_lora_rank`
buffers are allocated at start, whatever the number of registered adapters). `max_cpu_loras`
adapters are kept in host memory (LRU; vLLM's default: as many as `max_loras`); others are read
from disk again when a request needs them. `lora_modules` are registered at start (`name=path` or
vLLM's JSON form). Runtime registration (`/v1/load_lora_adapter`) needs
`allow_runtime_lora_updating` (vLLM gates it behind `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) and reads
only under `lora_root`: a path a client sends is a path on this server.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16
MAX_LORA_RANK = 512
# Names travel in `model`, metric labels (comma-joined lists) and gRPC fields: no spaces, no commas.
_NAME = re.compile(r"^[^\s,]{1,256}$")


def check_lora_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"LoRA adapter name must be 1-256 characters without spaces or commas, got {name!r}")


@dataclass(frozen=True)
class LoRAModule:
    """One adapter to register at start: `name` is what requests send as `model`."""

    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        check_lora_name(self.name)
        if not self.path:
            raise ValueError(f"LoRA adapter {self.name!r} needs a path")


def parse_lora_module(value: str) -> LoRAModule:
    """`name=path`, or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = value.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: invalid JSON {value!r}: {e.msg}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("path"), str):
            raise ValueError(f"--lora-modules: JSON needs string 'name' and 'path', got {value!r}")
        unknown = set(raw) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules: unknown keys {sorted(unknown)} in {value!r}")
        return LoRAModule(raw["name"], raw["path"], raw.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep:
        raise ValueError(f"--lora-modules: expected name=path or JSON, got {value!r}")
    return LoRAModule(name.strip(), path.strip())


def slot_rank(max_lora_rank: int) -> int:
    """The rank a slot stores: a power of two >= 16 (the kernels' tile; smaller ranks are zero-padded)."""
    rank = 16
    while rank < max_lora_rank:
        rank *= 2
    return rank


@dataclass(frozen=True)
class LoRAConfig:
    """Present (not None) in `EngineConfig.lora` when `--enable-lora` is given."""

    max_loras: int = DEFAULT_MAX_LORAS              # adapters in one batch = device slots
    max_cpu_loras: int | None = None                # adapters kept in host memory; None: max_loras
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    lora_modules: tuple[LoRAModule, ...] = ()
    allow_runtime_lora_updating: bool = False
    lora_root: str | None = None                    # runtime loads: only adapters under this directory

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}")
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        names = [m.name for m in self.lora_modules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"--lora-modules names an adapter more than once: {', '.join(duplicates)}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @property
    def slot_rank(self) -> int:
        return slot_rank(self.max_lora_rank)
