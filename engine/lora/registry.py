"""The adapters this engine serves, by name, and the host-memory cache of their weights.

Registering an adapter reads, checks and packs it (`read(path)`, engine/lora/manager.py), so an
adapter that does not fit fails at registration (a 400), never in a step; its identity (the
files' content hash) is fixed then. The host cache keeps `max_cpu_loras` adapters (LRU); one
evicted is read again by the next request for it (`load`, off the engine thread in pods), and
must still have the identity it was registered with: an adapter whose files changed since is
refused, never served as if it were the old one. A request holds its adapter's host copy
itself, so eviction never pulls weights from under a request.

Runtime registrations (`runtime=True`: the `/v1/load_lora_adapter` path) need
`allow_runtime_lora_updating` and a path that resolves (symlinks followed) under `lora_root`;
a relative path is taken relative to `lora_root`. Thread-safe: pods register from their event
loop's worker threads while the engine thread reads.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.lora.config import LoRAConfig, check_lora_name
from engine.lora.errors import (LoRAAdapterError, LoRAExistsError, LoRANotFoundError,
                                LoRAPermissionError)
from engine.lora.request import LoadedAdapter, LoRARequest


@dataclass(frozen=True)
class RegisteredAdapter:
    name: str
    path: str
    identity: str
    runtime: bool = False    # registered through the runtime API (not --lora-modules)


def runtime_path(path: str, config: LoRAConfig) -> str:
    """The real path a runtime load may read, or `LoRAPermissionError`."""
    if not config.allow_runtime_lora_updating:
        raise LoRAPermissionError("loading LoRA adapters at run time is disabled: start the pods with "
                                  "--allow-runtime-lora-updating (and --lora-root)")
    if not config.lora_root:
        raise LoRAPermissionError("loading LoRA adapters at run time needs --lora-root DIR: adapters are "
                                  "read only from under it")
    root = os.path.realpath(config.lora_root)
    real = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([real, root]) != root:
        raise LoRAPermissionError(f"lora_path {path!r} is outside --lora-root {config.lora_root}")
    return real


class LoRARegistry:
    def __init__(self, config: LoRAConfig, read: Callable[[str], LoadedAdapter]) -> None:
        self.config = config
        self._read = read
        self._lock = threading.Lock()
        self._by_name: dict[str, RegisteredAdapter] = {}
        self._cache: OrderedDict[str, LoadedAdapter] = OrderedDict()   # identity -> host copy, LRU first
        self.num_reads = 0

    def register(self, name: str, path: str, runtime: bool = False) -> RegisteredAdapter:
        """Read, check and register adapter `path` as `name` (slow: call off the engine thread)."""
        try:
            check_lora_name(name)
        except ValueError as e:
            raise LoRAAdapterError(str(e)) from None
        real = runtime_path(path, self.config) if runtime else path
        with self._lock:
            if name in self._by_name:
                raise LoRAExistsError(f"LoRA adapter {name!r} is already loaded")
        adapter = self._read_counted(real)
        with self._lock:
            if name in self._by_name:   # registered meanwhile by another caller
                raise LoRAExistsError(f"LoRA adapter {name!r} is already loaded")
            registered = self._by_name[name] = RegisteredAdapter(name, real, adapter.identity, runtime)
            self._keep(adapter)
        return registered

    def unregister(self, name: str) -> RegisteredAdapter:
        """Forget `name`: new requests for it are refused; running ones finish with their copy."""
        with self._lock:
            registered = self._by_name.pop(name, None)
            if registered is None:
                raise LoRANotFoundError(f"LoRA adapter {name!r} is not loaded")
            if not any(r.identity == registered.identity for r in self._by_name.values()):
                self._cache.pop(registered.identity, None)
        return registered

    def resolve(self, name: str) -> LoRARequest:
        """The request-side handle of `name`, with its host copy when cached (no disk read)."""
        with self._lock:
            registered = self._by_name.get(name)
            if registered is None:
                raise LoRANotFoundError(f"The model {name!r} does not exist (no base model or LoRA adapter of "
                                        "that name)")
            adapter = self._cache.get(registered.identity)
            if adapter is not None:
                self._cache.move_to_end(registered.identity)
        return LoRARequest(name, registered.identity, adapter)

    def load(self, lora: LoRARequest) -> LoRARequest:
        """Give `lora` its host copy, reading the files again if it was evicted (slow: off the
        engine thread in pods). Returns `lora`."""
        if lora.adapter is not None:
            return lora
        with self._lock:
            registered = self._by_name.get(lora.name)
            adapter = self._cache.get(lora.identity)
        if adapter is None:
            if registered is None or registered.identity != lora.identity:
                raise LoRANotFoundError(f"LoRA adapter {lora.name!r} was unloaded")
            adapter = self._read_counted(registered.path)
            if adapter.identity != lora.identity:
                raise LoRAAdapterError(f"LoRA adapter {lora.name!r} changed on disk since it was loaded "
                                       f"({registered.path}): load it again under a new name")
            with self._lock:
                self._keep(adapter)
        lora.adapter = adapter
        return lora

    def registered(self) -> list[RegisteredAdapter]:
        with self._lock:
            return list(self._by_name.values())

    def cached_identities(self) -> list[str]:
        with self._lock:
            return list(self._cache)

    def _read_counted(self, path: str) -> LoadedAdapter:
        adapter = self._read(path)
        with self._lock:
            self.num_reads += 1
        return adapter

    def _keep(self, adapter: LoadedAdapter) -> None:
        # Under the lock: newest last, the least recently used evicted past the capacity.
        self._cache[adapter.identity] = adapter
        self._cache.move_to_end(adapter.identity)
        while len(self._cache) > self.config.cpu_capacity:
            self._cache.popitem(last=False)
