"""A request's adapter: which one (name and identity) and, once read, its host copy (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_pool import ROOT_BLOCK_HASH

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False)
class LoadedAdapter:
    """An adapter read, checked and packed, in host memory (`images[r]`: tensor-parallel rank r's slot row)."""

    identity: str
    rank: int
    images: tuple[torch.Tensor, ...]
    target_modules: tuple[str, ...]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.images)


@dataclass(eq=False)
class LoRARequest:
    """`Request.lora`. The engine takes a request only with `adapter` set (pods read it in a
    worker thread first), and a request keeps its host copy alive whatever the host cache evicts.

    `root_hash` starts the request's prefix-cache hash chain (engine/block_pool.py) instead of
    `ROOT_BLOCK_HASH`: KV computed under one adapter is never served to another, or to the base
    model. It comes from the identity (the files' hash), never from the client-chosen name."""

    name: str
    identity: str
    adapter: LoadedAdapter | None = None
    root_hash: int = field(init=False)

    def __post_init__(self) -> None:
        self.root_hash = hash((ROOT_BLOCK_HASH, int(self.identity, 16)))
