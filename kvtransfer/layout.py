"""What a KV block is, and whether two pods agree on it.

The engine keeps one KV tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`;
block `b` is the contiguous byte range `kv[b]`. Two pods can exchange blocks only when every
dimension after the first, the dtype and the model itself (its fingerprint) agree, and so do
the layers' sliding windows (what each layer reads of the blocks, and so which blocks a decode
pod may free), the window behind which a pull sends no block (`kv_transfer_window`), and the KV
groups (`kv_group_windows`, `kv_page_slots`: with groups a block is a page of some layers, one
table per group, see `kvtransfer.kv_groups`). The
wire carries these facts in `cbserve_pb2.ModelInfo`; `check_compatible` turns a disagreement
into one message the pods return as `FAILED_PRECONDITION`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from wire import cbserve_pb2
from kvtransfer.errors import LayoutError

# The wire names of the KV dtypes (ModelInfo.kv_dtype) and their torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,   # --kv-cache-dtype fp8 (scales: engine/kv_dtype.py)
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    """Torch dtype for a wire name ("float32" | "float16" | "bfloat16" | "float8_e4m3fn"); `LayoutError`
    otherwise."""
    try:
        return DTYPES[name]
    except KeyError:
        raise LayoutError(f"unsupported KV dtype {name!r}; expected one of {sorted(DTYPES)}") from None


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one KV block: `[num_layers, 2, block_size, num_kv_heads, head_dim]`."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise LayoutError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_NAMES:
            raise LayoutError(f"unsupported KV dtype {self.dtype}; expected one of {sorted(DTYPES)}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: `(num_layers, 2, block_size, num_kv_heads, head_dim)`."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    @property
    def elements_per_block(self) -> int:
        return math.prod(self.block_shape)

    @property
    def bytes_per_block(self) -> int:
        return self.elements_per_block * self.dtype.itemsize

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens (the last one may be partial)."""
        return -(-num_tokens // self.block_size)

    @classmethod
    def from_tensor(cls, kv: torch.Tensor) -> KVLayout:
        """Layout of an engine KV tensor; `LayoutError` if it is not a contiguous 6-d KV cache."""
        if kv.dim() != 6 or kv.shape[2] != 2:
            raise LayoutError(
                "KV tensor must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
                f"got shape {tuple(kv.shape)}"
            )
        if not kv.is_contiguous():
            # Blocks are moved as raw byte ranges; a strided cache would need a gather per block.
            raise LayoutError("KV tensor must be contiguous so that each block is one byte range")
        _, num_layers, _, block_size, num_kv_heads, head_dim = kv.shape
        return cls(num_layers, block_size, num_kv_heads, head_dim, kv.dtype)

    @classmethod
    def from_model_info(cls, info: cbserve_pb2.ModelInfo) -> KVLayout:
        """The layout of what one message's block is: a whole-model block, or with KV groups a
        page of `kv_page_slots` layers."""
        return cls(info.kv_page_slots or info.num_layers, info.block_size, info.num_kv_heads, info.head_dim,
                   dtype_from_name(info.kv_dtype))

    def to_model_info(self, model_name: str, model_fingerprint: str, *, max_model_len: int = 0,
                      vocab_size: int = 0, layer_windows: tuple[int, ...] = (),
                      kv_transfer_window: int = 0, kv_group_windows: tuple[int, ...] = (),
                      num_model_layers: int = 0) -> cbserve_pb2.ModelInfo:
        """The `ModelInfo` a pod advertises (Handshake) and sends with `PullKV`; `layer_windows`:
        each layer's sliding window (0: full), empty when every layer is full;
        `kv_transfer_window`: the window every layer has, behind which a pull sends no block
        (0: none, every block is sent). `kv_group_windows`: a cache with KV groups (this layout
        is then a page's, of `num_layers` slots, and `num_model_layers` the model's layers)."""
        num_layers = num_model_layers if kv_group_windows else self.num_layers
        if kv_group_windows and num_model_layers < self.num_layers:
            raise LayoutError(f"a page of {self.num_layers} layers in a model of {num_model_layers}")
        if layer_windows and len(layer_windows) != num_layers:
            raise LayoutError(f"layer_windows has {len(layer_windows)} entries for {num_layers} layers")
        return cbserve_pb2.ModelInfo(
            model_name=model_name, model_fingerprint=model_fingerprint,
            block_size=self.block_size, kv_dtype=self.dtype_name, num_layers=num_layers,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            max_model_len=max_model_len, vocab_size=vocab_size, layer_windows=layer_windows,
            kv_transfer_window=kv_transfer_window, kv_group_windows=kv_group_windows,
            kv_page_slots=self.num_layers if kv_group_windows else 0,
        )

    def mismatch(self, info: cbserve_pb2.ModelInfo) -> str | None:
        """None if `info` describes the same block layout, else what differs (ours vs theirs)."""
        differences = [
            f"{name}: {ours!r} here vs {theirs!r} there"
            for name, ours, theirs in (
                ("block_size", self.block_size, info.block_size),
                ("kv_dtype", self.dtype_name, info.kv_dtype),
                ("num_layers", self.num_layers, info.num_layers),
                ("num_kv_heads", self.num_kv_heads, info.num_kv_heads),
                ("head_dim", self.head_dim, info.head_dim),
            )
            if ours != theirs
        ]
        return "; ".join(differences) or None


def check_compatible(local: cbserve_pb2.ModelInfo, remote: cbserve_pb2.ModelInfo) -> str | None:
    """None if a pod running `local` can exchange KV with one running `remote`, else why not.

    The model must be the same (equal, non-empty `model_fingerprint`: an empty one proves nothing,
    and KV from another model decodes into fluent garbage rather than an error), and so must the
    block layout. `model_name`, `max_model_len` and `vocab_size` are not compared: the name is
    only a label, and the other two follow from the fingerprint. Pods map a non-None result to
    `FAILED_PRECONDITION`.
    """
    problems: list[str] = []
    if not local.model_fingerprint or not remote.model_fingerprint:
        side = "local" if not local.model_fingerprint else "remote"
        problems.append(f"model_fingerprint is empty on the {side} side")
    elif local.model_fingerprint != remote.model_fingerprint:
        problems.append(
            f"model_fingerprint: {local.model_fingerprint!r} ({local.model_name or '?'}) here vs "
            f"{remote.model_fingerprint!r} ({remote.model_name or '?'}) there"
        )
    # kv_transfer_window: which blocks a pull moves (a pod from before it sends all of them);
    # kv_page_slots: what a page holds with KV groups (0: whole-model blocks).
    for name in ("block_size", "kv_dtype", "num_layers", "num_kv_heads", "head_dim", "kv_transfer_window",
                 "kv_page_slots"):
        ours, theirs = getattr(local, name), getattr(remote, name)
        if ours != theirs:
            problems.append(f"{name}: {ours!r} here vs {theirs!r} there")
    if list(local.layer_windows) != list(remote.layer_windows):
        problems.append(f"layer_windows: {list(local.layer_windows) or 'none'} here vs "
                        f"{list(remote.layer_windows) or 'none'} there")
    if list(local.kv_group_windows) != list(remote.kv_group_windows):
        # Which pages a pull moves of which table: a pod with one group (speculative decoding, or
        # from before KV groups in P/D) sends and expects every layer's KV in one block.
        problems.append(f"kv_group_windows (KV cache groups): {list(local.kv_group_windows) or 'one group'} here vs "
                        f"{list(remote.kv_group_windows) or 'one group'} there (a speculating pod runs one group: "
                        "start the other side with --kv-cache-groups single, or both with the same speculation)")
    if not problems:
        return None
    return "KV layouts are incompatible: " + "; ".join(problems)
