"""`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's bodies and answers), fanned out
to every pod of the pools, and the adapter cards of `/v1/models`.

Loading is off unless the router runs with `--allow-runtime-lora-updating` (403 otherwise, as
vLLM gates it behind `VLLM_ALLOW_RUNTIME_LORA_UPDATING`); each pod also needs
`--allow-runtime-lora-updating` and reads only under its `--lora-root`: `lora_path` is a path on
the pods, chosen by whoever holds the API key.

A load goes to every pod the router tracks, at once. Every pod checks the adapter against its
model; if one refuses it (a bad adapter: 400 with its reason; a path outside the root: 403), the
load is undone on the pods that took it, so no pool half-serves an adapter. Pods that cannot be
reached (down, restarting) get it later: the router keeps the adapters it loaded and loads them
onto any pod whose reports lack them (`Reconciler`, e.g. a pod the autoscaler added). Before
answering 200 the router reads the pods' load reports again, so the adapter is routable the
moment the client hears it is loaded. An unload refuses new requests for the name on every pod;
requests already admitted finish with it (docs/architecture.md, "Multi-LoRA").

Adapters loaded at run time live in the pods' memory and this router's: a restarted router
forgets them (the pods keep them), a restarted pod gets them back from the router that loaded
them. Declare adapters that must survive both in the deployment (`--lora-modules`, the chart's
`lora.modules`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from engine.lora.config import check_lora_name
from router.errors import APIError, bad_request, not_found, unavailable
from router.load import LoadTracker, PodState
from router.lora.state import adapters_of, served_adapters

log = logging.getLogger(__name__)
CALL_TIMEOUT_SECONDS = 60.0     # reading and checking a large adapter on a loaded pod
RECONCILE_SECONDS = 2.0
RETRY_SECONDS = 10.0            # a pod that failed to take an adapter is asked again after this
_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.PERMISSION_DENIED: 403,
             grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.ALREADY_EXISTS: 400}


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str
    lora_int_id: int | None = None     # vLLM's; names identify adapters here


def model_cards(state, created: int) -> list[dict[str, Any]]:
    """`/v1/models` entries of the adapters the routable pods serve, their base as `parent` (vLLM)."""
    if not state.config.enable_lora:
        return []
    base = state.config.model_name
    return [{"id": name, "object": "model", "created": created, "owned_by": "cbserve", "root": name,
             "parent": base, "max_model_len": state.max_model_len()}
            for name in served_adapters(state.dispatcher.tracker.pods.values())]


def _failure(pod: PodState, error: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, message) of a pod's failed call; anything but a gRPC status counts as unreachable."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), f"{pod.role} pod {pod.address}: {error.details()}"
    return grpc.StatusCode.UNAVAILABLE, f"{pod.role} pod {pod.address}: {type(error).__name__}: {error}"


class LoRAAdmin:
    """The runtime adapter API of one router and the adapters it keeps loaded on every pod."""

    def __init__(self, tracker: LoadTracker) -> None:
        self.tracker = tracker
        self.loaded: dict[str, str] = {}                  # name -> path, loaded through this router
        self._tried: dict[tuple[str, str], float] = {}    # (pod, name) -> monotonic time of the last try
        self._lock = asyncio.Lock()                       # one load or unload at a time
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._reconcile_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _pods(self) -> list[PodState]:
        return [p for p in self.tracker.pods.values() if p.healthy]

    async def load(self, name: str, path: str) -> None:
        """Load on every pod, or on none (APIError with the first refusal)."""
        async with self._lock:
            if name in self.loaded:
                # Known here, whichever pods have it now: one that missed the first load (down, or
                # out of routing for a moment) gets it from the reconciler, not from a second load,
                # which would otherwise answer 200 or 400 depending on that pod's timing.
                raise bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            pods = self._pods()
            if not pods:
                raise unavailable("No pod is ready to load a LoRA adapter on.")
            results = await asyncio.gather(*(p.client.load_lora_adapter(name, path, CALL_TIMEOUT_SECONDS)
                                             for p in pods), return_exceptions=True)
            took = [p for p, r in zip(pods, results) if not isinstance(r, BaseException)]
            errors = [_failure(p, r) for p, r in zip(pods, results) if isinstance(r, BaseException)]
            refused = [(code, message) for code, message in errors if code in _REFUSALS]
            exists = [1 for code, _ in refused if code == grpc.StatusCode.ALREADY_EXISTS]
            if refused and len(exists) < len(refused):      # a real refusal: undo where it was taken
                await self._unload_from(took, name)
                code, message = next((c, m) for c, m in refused if c != grpc.StatusCode.ALREADY_EXISTS)
                raise APIError(_REFUSALS[code], f"The LoRA adapter '{name}' was not loaded: {message}",
                               param="lora_path", code="lora_adapter_refused")
            if not took:
                if exists:
                    raise bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
                raise unavailable(f"The LoRA adapter '{name}' was not loaded: "
                                  + "; ".join(message for _, message in errors))
            self.loaded[name] = path
            for code, message in errors:
                if code not in _REFUSALS:   # down or restarting: the reconciler loads it there later
                    log.warning("LoRA adapter %s: %s; it will be loaded there when the pod is back", name, message)
            await self._refresh(took)
            log.info("LoRA adapter %s loaded from %s on %d pods", name, path, len(took))

    async def unload(self, name: str) -> None:
        async with self._lock:
            pods = self._pods()
            self.loaded.pop(name, None)
            found = await self._unload_from(pods, name)
            if not found:
                raise not_found(f"The lora adapter '{name}' cannot be found.", code="model_not_found")
            log.info("LoRA adapter %s unloaded from %d pods", name, len(found))

    async def _unload_from(self, pods: list[PodState], name: str) -> list[PodState]:
        results = await asyncio.gather(*(p.client.unload_lora_adapter(name, CALL_TIMEOUT_SECONDS) for p in pods),
                                       return_exceptions=True)
        for p, r in zip(pods, results):
            if isinstance(r, grpc.aio.AioRpcError) and r.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("LoRA adapter %s: unload on %s pod %s failed: %s", name, p.role, p.address, r.details())
        done = [p for p, r in zip(pods, results) if not isinstance(r, BaseException)]
        await self._refresh(done)
        return done

    async def _refresh(self, pods: list[PodState]) -> None:
        """Read the pods' load reports now: routing sees the change before the client hears of it."""
        reports = await asyncio.gather(*(p.client.get_load(5.0) for p in pods), return_exceptions=True)
        now = time.monotonic()
        for p, report in zip(pods, reports):
            if not isinstance(report, BaseException):
                p.apply_report(report, now)

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_SECONDS)
            try:
                await self.reconcile()
            except Exception:  # noqa: BLE001 - keep reconciling
                log.exception("LoRA reconciliation failed")

    async def reconcile(self) -> None:
        """Load the adapters this router loaded onto every healthy pod whose report lacks them."""
        if not self.loaded or self._lock.locked():
            return
        now = time.monotonic()
        for pod in self._pods():
            if pod.report is None:
                continue
            have = adapters_of(pod)
            for name, path in list(self.loaded.items()):
                key = (pod.address, name)
                if (name in have and have[name].registered) or now - self._tried.get(key, -RETRY_SECONDS) < RETRY_SECONDS:
                    continue
                self._tried[key] = now
                try:
                    await pod.client.load_lora_adapter(name, path, CALL_TIMEOUT_SECONDS)
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                        log.warning("LoRA adapter %s: loading on %s pod %s failed: %s", name, pod.role,
                                    pod.address, e.details())
                    continue
                log.info("LoRA adapter %s loaded on %s pod %s, which lacked it", name, pod.role, pod.address)
                await self._refresh([pod])


def add_lora_routes(app: FastAPI, serving, check_api_key) -> None:
    """Mount the two runtime endpoints (`serving(request)`: the app's `ServingState`)."""

    def admin(request: Request) -> LoRAAdmin:
        state = serving(request)
        if not state.config.allow_runtime_lora_updating:
            raise APIError(403, "Loading LoRA adapters at run time is disabled: start the router with "
                           "--allow-runtime-lora-updating (chart: lora.allowRuntimeUpdating)",
                           type="permission_error", code="runtime_lora_updating_disabled")
        return request.app.state.lora_admin

    async def body(request: Request, model: type[BaseModel]) -> Any:
        from router.serving import parse_body
        return await parse_body(request, model, serving(request).config.max_request_body_bytes)

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(check_api_key)])
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        lora = admin(request)
        data = await body(request, LoadLoRAAdapterRequest)
        try:
            check_lora_name(data.lora_name)
        except ValueError as e:
            raise bad_request(str(e), param="lora_name") from None
        if data.lora_name == serving(request).config.model_name:
            raise bad_request(f"lora_name '{data.lora_name}' is the base model's name", param="lora_name")
        if not data.lora_path:
            raise bad_request("lora_path is required", param="lora_path")
        await lora.load(data.lora_name, data.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{data.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(check_api_key)])
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        lora = admin(request)
        data = await body(request, UnloadLoRAAdapterRequest)
        await lora.unload(data.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{data.lora_name}' removed successfully.")
