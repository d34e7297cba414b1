"""The server process's half of runtime LoRA loading: a `LoadLoRAAdapter` / `UnloadLoRAAdapter`
call forwarded to the engine core, whose answer (`pod/lora.py`, `lora_command`) becomes the RPC's.

Its own module, below `pod.runtime` (which serves the RPCs) and importing nothing of `pod/`:
`pod.lora` runs in the engine core on top of `pod.runtime`.
"""

from __future__ import annotations

import asyncio

import grpc

from wire import cbserve_pb2

_STATUS = {code.value[0]: code for code in grpc.StatusCode}


async def lora_rpc(runtime, kind: str, request, context) -> cbserve_pb2.LoRAAdapterResponse:
    """Server process: a Load/UnloadLoRAAdapter call (`kind`: its `CoreCommand` field), answered
    by the engine core: the adapter's identity, or the core's status and message."""
    command = cbserve_pb2.CoreCommand()
    getattr(command, kind).CopyFrom(request)
    reply = await asyncio.wrap_future(runtime.loop.call(command))
    if reply.code:
        await context.abort(_STATUS.get(reply.code, grpc.StatusCode.INTERNAL), reply.message)
    return cbserve_pb2.LoRAAdapterResponse(identity=reply.message)
