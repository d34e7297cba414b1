"""Adapter state as the pods report it (load reports, metrics); torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAAdapterStats:
    """One adapter this engine knows: registered, or still serving requests after an unload."""

    name: str
    identity: str            # content hash of the adapter's files (engine/lora/adapter.py)
    registered: bool         # requests may name it (False: unloaded, its last requests still run)
    resident: bool           # in a device slot now (a request for it needs no copy)
    num_running: int = 0
    num_waiting: int = 0


def requests_info_labels(adapters: tuple[LoRAAdapterStats, ...], max_loras: int) -> dict[str, str]:
    """The labels of vLLM's `vllm:lora_requests_info` gauge (which the Gateway API inference
    extension's LoRA affinity reads): comma-joined names with running / waiting requests."""
    return {"running_lora_adapters": ",".join(sorted(a.name for a in adapters if a.num_running)),
            "waiting_lora_adapters": ",".join(sorted(a.name for a in adapters if a.num_waiting)),
            "max_lora": str(max_loras)}


def stats_to_pb(adapters: tuple[LoRAAdapterStats, ...], field) -> None:
    """Into a repeated `LoRAAdapterState` field (load reports, the engine core's statistics)."""
    for a in adapters:
        field.add(name=a.name, identity=a.identity, registered=a.registered, resident=a.resident,
                  num_running=a.num_running, num_waiting=a.num_waiting)


def stats_from_pb(field) -> tuple[LoRAAdapterStats, ...]:
    return tuple(LoRAAdapterStats(a.name, a.identity, a.registered, a.resident, a.num_running, a.num_waiting)
                 for a in field)
