"""`LoRAManager`: the engine's adapters — registry, device slots, and the copy into a slot.

Built by the engine after its model is loaded (and quantized), before the KV cache is sized, so
the slots' memory counts as the model's. Startup adapters (`--lora-modules`) are registered
here; runtime ones through `registry.register(..., runtime=True)` from a pod's worker thread.

The engine thread does only this: between `schedule()` and the step's forward, copy each adapter
the scheduler just gave a slot into it (`activate_loads`: one row copy; under tensor parallelism
one scatter, each rank receiving its own shard). Reading, checking and packing an adapter
happen before a request reaches the engine (`request`, synchronous for offline use; pods call
`registry.load` in a worker thread first).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from engine.lora.adapter import read_adapter
from engine.lora.config import LoRAConfig
from engine.lora.layers import attach_lora
from engine.lora.pack import slot_images
from engine.lora.registry import LoRARegistry
from engine.lora.request import LoadedAdapter, LoRARequest
from engine.lora.slots import LoRASlots
from engine.lora.stats import LoRAAdapterStats
from engine.model_config import ModelConfig
from engine.tp.comm import CMD_LORA_SLOT
from engine.tp.shard import TPShard

log = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, config: LoRAConfig, model, model_cfg: ModelConfig, tp=None) -> None:
        """`model_cfg`: the global config; `tp` (`engine.tp.launch.TPDriver`): rank 0 of a group."""
        self.config = config
        self.tp = tp
        size = 1 if tp is None else tp.comm.size
        self._shards = [None] if size == 1 else [TPShard(model_cfg, r, size) for r in range(size)]
        self._model_cfg = model_cfg
        self._renames = type(model).hf_renames
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.model = attach_lora(model, config.max_loras, config.slot_rank, self._shards[0])
        self.registry = LoRARegistry(config, self._read)
        self.slots = LoRASlots(config.max_loras)
        for module in config.lora_modules:
            registered = self.registry.register(module.name, module.path)
            log.info("LoRA adapter %s registered from %s (identity %s)", module.name, module.path, registered.identity)
        log.info("LoRA: %d slots of rank %d (%.1f MiB on %s), %d adapters in host memory at most",
                 config.max_loras, config.slot_rank, self.model.device_bytes / 2**20, self.device, config.cpu_capacity)

    def _read(self, path: str) -> LoadedAdapter:
        """Read, check and pack an adapter for every rank (any thread)."""
        weights = read_adapter(path, self.model.targets, self._model_cfg, self._renames, self.config.max_lora_rank)
        images = slot_images(weights, self.model.targets, self.model.slot_numel, self.dtype, self._shards,
                             pin_memory=self.device.type == "cuda")
        return LoadedAdapter(weights.identity, weights.config.rank, tuple(images), weights.target_modules)

    def request(self, lora: str | LoRARequest) -> LoRARequest:
        """A request's adapter, by name or handle, with its host copy (reads the files if needed:
        the offline path; pods load in a worker thread before the engine sees the request)."""
        if isinstance(lora, str):
            lora = self.registry.resolve(lora)
        return self.registry.load(lora)

    def activate_loads(self) -> None:
        """Engine thread, after `schedule()`: copy every adapter given a slot into it."""
        for slot, adapter in self.slots.take_loads():
            if self.tp is None:
                self.model.write_slot(slot, adapter.images[0])
                continue
            parts = [image.view(torch.uint8).to(self.device) for image in adapter.images]
            with self.tp.exclusive(CMD_LORA_SLOT, slot) as comm:
                comm.scatter_from_first(parts, self.model.storage[slot].view(torch.uint8))

    def stats(self, scheduler) -> tuple[LoRAAdapterStats, ...]:
        """Every registered adapter and every adapter still in use, with its request counts
        (engine thread; O(requests): for load reports, not for every step)."""
        running = Counter(r.lora.name for r in scheduler.running if r.lora is not None)
        queued = [*scheduler.waiting.unordered(), *scheduler.waiting_for_blocks,
                  *scheduler.waiting_for_remote_kv.values()]
        waiting = Counter(r.lora.name for r in queued if r.lora is not None)
        identities = {r.lora.name: r.lora.identity for r in (*scheduler.running, *queued) if r.lora is not None}
        registered = {a.name: a.identity for a in self.registry.registered()}
        out = []
        for name in sorted(set(registered) | set(identities)):
            identity = registered.get(name) or identities[name]
            out.append(LoRAAdapterStats(name, identity, name in registered, self.slots.resident(identity),
                                        running[name], waiting[name]))
        return tuple(out)


def serve_lora_command(comm, slot: int, storage: torch.Tensor) -> None:
    """Tensor-parallel ranks > 0: receive this rank's shard of an adapter into slot `slot`."""
    comm.scatter_from_first(None, storage[slot].view(torch.uint8))
