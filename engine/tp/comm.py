"""The collectives of one tensor-parallel group, and the step message rank 0 sends the others.

Every rank runs the same model code; `TPComm` is what the model calls at its two row-parallel
projections per layer (all-reduce), the vocab-parallel embedding (all-reduce) and the head
(all-gather of the vocab shards). Backends: NCCL on CUDA, Gloo on CPU.

Step message: rank 0 alone schedules. Before each forward it broadcasts a 7-int64 header
(command and the `engine.step_inputs.Layout` of the step), then the step's staged input bytes (the
one buffer `StepInputs` already packs: ids, positions, slots, block tables, ...). Tensors only;
nothing is pickled. The other ranks rebuild the same views over the same bytes and run the same
forward, so every collective of the step pairs up.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from engine.step_inputs import Layout

CMD_STEP, CMD_HEARTBEAT, CMD_STOP = 1, 2, 3
CMD_KV_GATHER, CMD_KV_SCATTER = 4, 5     # KV transfer of a P/D pod (engine/tp/kv.py)
CMD_LORA_SLOT = 6                        # an adapter into a slot (engine/lora/manager.py), count = slot
HEADER_LEN = 8


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TPComm:
    """This process's view of the default process group (one tensor-parallel group per process)."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device

    @classmethod
    def init(cls, rank: int, size: int, device: torch.device, store: dist.Store, timeout_s: float) -> TPComm:
        """Join the group through `store` (rank 0 hosts it); collectives time out after `timeout_s`."""
        dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        return cls(rank, size, device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `x`."""
        dist.all_reduce(x)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """`[N, C]` on every rank -> `[N, size * C]`, rank r's columns at `[r*C, (r+1)*C)`."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=1)

    def min_int(self, value: int) -> int:
        """The smallest `value` over ranks (each rank sizes its own KV cache; all keep the least)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    # ------------------------------------------------------------------ the step message
    def send_header(self, command: int, layout: Layout | None = None, count: int = 0) -> None:
        """Rank 0: announce the next message (a step's `layout`, or a KV command's block `count`)."""
        fields = (count, 0, 0, 0, 0, 0, 0) if layout is None else tuple(layout)   # every Layout field
        dist.broadcast(torch.tensor((command, *fields), dtype=torch.int64, device=self.device), src=0)

    def recv_header(self) -> tuple[int, Layout | int]:
        """Other ranks: wait for rank 0's next header -> (command, the step's layout, or the KV
        command's block count)."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        command, *fields = header.tolist()
        return command, (Layout(*fields) if command == CMD_STEP else fields[0])

    def broadcast_bytes(self, buf: torch.Tensor) -> None:
        """The staged step inputs (`uint8`), rank 0's bytes into everyone's buffer."""
        dist.broadcast(buf, src=0)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=0)
        return t

    def gather_to_first(self, local: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `local` (same shape) -> the list on rank 0, None elsewhere."""
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local.contiguous(), parts, dst=0)
        return parts

    def scatter_from_first(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> torch.Tensor:
        """Rank 0's `parts[r]` into rank r's `out`."""
        dist.scatter(out, parts, src=0)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
