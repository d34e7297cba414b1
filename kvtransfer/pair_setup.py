"""Setting up a `PairGroup` over `SetupTransport` (the gRPC side of the collective transport).

Decode pod (initiator; it hosts one store for all its pairs, per the wire contract, which sends
the store address in `SetupTransportRequest`)::

    store = host_store(pod_host, 0)                          # once per pod, on its --host
    group = await open_pair(prefill_stub, store, advertise_host=pod_ip,
                            group_name=f"{decode_pod_id}->{prefill_pod_id}", backend="nccl",
                            device=kv.device, bind_host=gloo_bind_host(pod_host))

Prefill pod, in its `SetupTransport` handler::

    self.groups[request.group] = await accept_pair(request, device=kv.device,
                                                   bind_host=gloo_bind_host(pod_host))
    return cbserve_pb2.SetupTransportResponse()

`open_pair` sends the request and joins as rank 1 at the same time; `accept_pair` joins as
rank 0 and the RPC answers once the pair is connected, so both sides hold a ready group when
`open_pair` returns. Group names must be unique per (decode, prefill) pair and per attempt: a
pair that broke is replaced under a new name (e.g. with a counter suffix).
"""

from __future__ import annotations

import asyncio

import torch
import torch.distributed as dist

from wire import cbserve_pb2
from kvtransfer.collective import PairGroup, connect_store


async def open_pair(stub, store: dist.TCPStore, *, advertise_host: str, group_name: str,
                    backend: str = "gloo", device: torch.device | str = "cpu",
                    timeout_s: float = 30.0, setup_timeout_s: float = 60.0,
                    bind_host: str | None = None) -> PairGroup:
    """Decode side: ask the prefill pod behind `stub` to join `group_name`, join as rank 1.

    `advertise_host` is this pod's address as the prefill pod can reach it (the store listens
    on `store.port`). Raises the RPC's error (`grpc.aio.AioRpcError`) or `SourceLostError`.
    """
    request = cbserve_pb2.SetupTransportRequest(group=group_name, store_host=advertise_host,
                                                store_port=store.port, backend=backend)
    join = asyncio.ensure_future(PairGroup.create(
        store, group_name, rank=1, backend=backend, device=device, timeout_s=timeout_s,
        setup_timeout_s=setup_timeout_s, bind_host=bind_host))
    try:
        await stub.SetupTransport(request, timeout=setup_timeout_s)
    except BaseException:
        join.cancel()  # the rendezvous thread itself ends at its own timeout
        raise
    return await join


async def accept_pair(request: cbserve_pb2.SetupTransportRequest, *,
                      device: torch.device | str = "cpu", timeout_s: float = 30.0,
                      setup_timeout_s: float = 60.0, bind_host: str | None = None) -> PairGroup:
    """Prefill side: join the pair described by a `SetupTransportRequest` as rank 0."""
    if request.backend not in ("gloo", "nccl"):
        raise ValueError(f"SetupTransport backend must be 'gloo' or 'nccl', got {request.backend!r}")
    if not request.group or not request.store_host or not 0 < request.store_port < 65536:
        raise ValueError("SetupTransport needs group, store_host and store_port")
    store = await asyncio.to_thread(connect_store, request.store_host, request.store_port,
                                    setup_timeout_s)
    return await PairGroup.create(store, request.group, rank=0, backend=request.backend,
                                  device=device, timeout_s=timeout_s,
                                  setup_timeout_s=setup_timeout_s, bind_host=bind_host)
