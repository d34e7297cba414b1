"""LoRA metrics of one pod, with vLLM's names (`vllm:lora_requests_info`) under the cbserve prefix.

`cbserve_lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}` is a gauge
whose labels carry the state and whose value is the time of the update (unix seconds), as vLLM's:
the Gateway API inference extension's LoRA affinity reads exactly these labels. One series at a
time (the previous one is dropped). `cbserve_lora_adapters{state}` counts registered adapters and
those resident in a device slot.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Gauge

from engine.lora.stats import requests_info_labels

INFO_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")


class LoRAMetrics:
    def __init__(self, role: str, registry: CollectorRegistry) -> None:
        self.role = role
        self._info = Gauge("cbserve_lora_requests_info", "Running and waiting LoRA adapters (value: update time)",
                           ["role", *INFO_LABELS], registry=registry)
        self._adapters = Gauge("cbserve_lora_adapters", "LoRA adapters registered, and resident in a device slot",
                               ["role", "state"], registry=registry)

    def update(self, adapters, max_loras: int) -> None:
        if not max_loras:          # LoRA disabled: no series at all
            return
        labels = requests_info_labels(adapters, max_loras)
        self._info.clear()
        self._info.labels(self.role, *(labels[k] for k in INFO_LABELS)).set(time.time())
        self._adapters.labels(self.role, "registered").set(sum(a.registered for a in adapters))
        self._adapters.labels(self.role, "resident").set(sum(a.resident for a in adapters))
