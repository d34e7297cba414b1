"""LoRA adapters in a pod: requests naming one, runtime loading, and the adapters' state on the wire.

Intake (engine core, event loop): a request's `lora_name` is resolved against the engine's
registry (unknown: NOT_FOUND), and an adapter whose host copy was evicted is read again in a
worker thread before the request reaches the engine, so the engine thread never reads a file
(`with_adapter`). A decode pod pulls with its identity of the adapter; a prefill pod refuses a
pull whose identity differs from its own request's (FAILED_PRECONDITION): the KV depends on it.

Runtime loading (`LoadLoRAAdapter` / `UnloadLoRAAdapter`, both pod services): the server
forwards the call to the engine core, which reads, checks and registers the adapter in a worker
thread (`--allow-runtime-lora-updating`, paths under `--lora-root`), refreshes the statistics the
server reports, then replies; a bad adapter is INVALID_ARGUMENT with the reason, never a crash.
Unloading refuses new requests for the name at once; requests already admitted finish with their
adapter (they hold its host copy, and their slot until they leave the batch): nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from engine.lora.errors import (LoRAAdapterError, LoRAError, LoRAExistsError, LoRANotFoundError,
                                LoRAPermissionError)
from engine.lora.request import LoRARequest
from pod.runtime import RequestFailed
from wire import cbserve_pb2

log = logging.getLogger(__name__)
LORA_COMMANDS = ("load_lora_adapter", "unload_lora_adapter")
_CODES = ((LoRANotFoundError, grpc.StatusCode.NOT_FOUND), (LoRAExistsError, grpc.StatusCode.ALREADY_EXISTS),
          (LoRAPermissionError, grpc.StatusCode.PERMISSION_DENIED),
          (LoRAAdapterError, grpc.StatusCode.INVALID_ARGUMENT))


def status_of(error: LoRAError) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INVALID_ARGUMENT


def _disabled(role: str) -> RequestFailed:
    return RequestFailed(grpc.StatusCode.FAILED_PRECONDITION,
                         f"LoRA adapters are not enabled on this {role} pod: start it with --enable-lora")


def lora_request(runtime, request) -> LoRARequest | None:
    """Engine core: the adapter a Prefill/Generate request names (None: the base model), or
    RequestFailed (NOT_FOUND for a name this pod does not serve)."""
    if not request.lora_name:
        return None
    engine = runtime.engine
    if engine.lora is None:
        raise _disabled(runtime.role_label)
    try:
        return engine.lora.registry.resolve(request.lora_name)
    except LoRAError as e:
        runtime.metrics.rejected("lora")
        raise RequestFailed(status_of(e), f"{e} on {runtime.role_label} pod {runtime.pod_id}") from None


def with_adapter(runtime, lora: LoRARequest | None, then: Callable[[], None],
                 fail: Callable[[RequestFailed], None]) -> None:
    """Event loop: `then()` now if the request's adapter is in host memory (or it has none), else
    once a worker thread has read it back; `fail(error)` if it cannot be read."""
    if lora is None or lora.adapter is not None:
        then()
        return

    async def load() -> None:
        try:
            await asyncio.to_thread(runtime.engine.lora.registry.load, lora)
        except LoRAError as e:
            fail(RequestFailed(status_of(e), str(e)))
            return
        then()
    asyncio.get_running_loop().create_task(load())


def identity_mismatch(request_id: str, theirs: str, ours: str) -> str | None:
    """Why a pull must be refused (the decode pod's adapter identity differs from ours), or None."""
    if theirs == ours:
        return None
    what = lambda identity: f"LoRA adapter {identity}" if identity else "the base model"   # noqa: E731
    return (f"request {request_id!r}: the decode pod runs it with {what(theirs)}, this prefill pod computed "
            f"its KV with {what(ours)}: the KV is not usable (load the same adapter files on both pools)")


# ---------------------------------------------------------------------------------------------- runtime loading
def lora_command(core, kind: str, command: cbserve_pb2.CoreCommand) -> None:
    """Engine core, event loop: run a load/unload command without blocking the loop."""
    asyncio.get_running_loop().create_task(_lora_command(core, kind, command))


async def _lora_command(core, kind: str, command: cbserve_pb2.CoreCommand) -> None:
    rt = core.rt
    try:
        if rt.engine.lora is None:
            raise _disabled(rt.role_label)
        registry = rt.engine.lora.registry
        if kind == "load_lora_adapter":
            body = command.load_lora_adapter
            registered = await asyncio.to_thread(registry.register, body.lora_name, body.lora_path, True)
            log.info("LoRA adapter %s loaded from %s (identity %s)", registered.name, registered.path,
                     registered.identity)
        else:
            registered = registry.unregister(command.unload_lora_adapter.lora_name)
            log.info("LoRA adapter %s unloaded (its running requests finish with it)", registered.name)
    except RequestFailed as e:
        core.reply(command.call_id, e.code, str(e))
        return
    except LoRAError as e:
        core.reply(command.call_id, status_of(e), str(e))
        return
    except Exception as e:  # noqa: BLE001 - the caller waits for a reply: it gets one
        log.exception("LoRA %s failed", kind)
        core.reply(command.call_id, grpc.StatusCode.INTERNAL, f"{kind} failed: {e}")
        return

    def refresh(engine) -> None:   # engine thread: the server's next load report lists the change
        rt.refresh(engine, rt.num_held)
        core.outputs([])
    await rt.loop.run(refresh)
    core.reply(command.call_id, message=registered.identity)
