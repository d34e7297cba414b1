"""A minimal `PrefillService` that serves only `PullKV`: for tests and benchmarks, and the
shape the prefill pod's real handler follows (compatibility check, lease via the stream,
typed errors mapped to status codes).

It is not the pod: there is no engine. Callers register a request with `add_request` and drive
its `KVProgress` by hand (or from a thread), as the engine would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import torch

from wire import cbserve_pb2, cbserve_pb2_grpc
from kvtransfer.collective import PairGroup
from kvtransfer.errors import LayoutError, SourceAbortedError
from kvtransfer.grpc_options import server_options
from kvtransfer.grpc_transport import KVSource
from kvtransfer.layout import check_compatible
from kvtransfer.pair_setup import accept_pair
from kvtransfer.progress import KVProgress

ChunkFilter = Callable[[cbserve_pb2.KVChunk], cbserve_pb2.KVChunk]


class PullKVServicer(cbserve_pb2_grpc.PrefillServiceServicer):
    """Serves `PullKV` for requests registered with `add_request`.

    `closed[request_id]` is set when the stream ends for any reason, and `outcomes[request_id]`
    says how ("finished", "cancelled", "aborted: ...") — the moment a pod would release the
    request's blocks. `chunk_filter` may rewrite each outgoing chunk (fault injection).
    """

    def __init__(self, kv: torch.Tensor, model_info: cbserve_pb2.ModelInfo, *,
                 groups: dict[str, PairGroup] | None = None,
                 chunk_filter: ChunkFilter | None = None) -> None:
        self.kv = kv
        self.model_info = model_info
        self.groups = groups if groups is not None else {}
        self.chunk_filter = chunk_filter
        self.progress: dict[str, KVProgress] = {}
        self.closed: dict[str, asyncio.Event] = {}
        self.outcomes: dict[str, str] = {}
        self.start_block_index: dict[str, int] = {}
        self.group_starts: dict[str, tuple[int, ...]] = {}

    def add_request(self, request_id: str, num_prompt_tokens: int, start_block_index: int = 0,
                    group_start_block_indices: tuple[int, ...] = ()) -> KVProgress:
        """`start_block_index`: the pull sends the blocks from there on (a window model's);
        `group_start_block_indices`: a cache with KV groups, where groups 1.. start (the
        progress then reports their tables: `kvtransfer.kv_groups`)."""
        self.progress[request_id] = progress = KVProgress(num_prompt_tokens)
        self.closed[request_id] = asyncio.Event()
        self.start_block_index[request_id] = start_block_index
        self.group_starts[request_id] = tuple(group_start_block_indices)
        return progress

    async def PullKV(self, request: cbserve_pb2.PullKVRequest, context: grpc.aio.ServicerContext):
        if problem := check_compatible(self.model_info, request.model):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        progress = self.progress.get(request.request_id)
        if progress is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no KV for {request.request_id!r}")
        group = None
        if request.transport == "nccl":
            group = self.groups.get(request.nccl_group)
            if group is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"no process group {request.nccl_group!r}; call SetupTransport")
        # The stream is the lease: the done callback runs as soon as the RPC ends, whether it
        # finished, failed, or the peer cancelled/vanished (the handler task is cancelled too).
        context.add_done_callback(lambda ctx: self._on_done(request.request_id, ctx))
        try:
            source = KVSource(self.kv, request.request_id, progress.num_prompt_tokens,
                              max_chunk_bytes=request.max_chunk_bytes, group=group,
                              start_block_index=self.start_block_index[request.request_id],
                              group_start_block_indices=self.group_starts[request.request_id])
            async for chunk in source.chunks(progress.events()):
                yield self.chunk_filter(chunk) if self.chunk_filter else chunk
            self.outcomes[request.request_id] = "finished"
        except (asyncio.CancelledError, GeneratorExit):
            # The peer cancelled, vanished, or its deadline passed: gRPC cancels the handler at
            # its current await. (`context.cancelled()` stays False for client-side cancels.)
            self.outcomes[request.request_id] = "cancelled"
            raise
        except SourceAbortedError as error:
            self.outcomes[request.request_id] = f"aborted: {error}"
            await context.abort(grpc.StatusCode.ABORTED, str(error))
        except LayoutError as error:
            self.outcomes[request.request_id] = f"aborted: {error}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

    def _on_done(self, request_id: str, context: grpc.aio.ServicerContext) -> None:
        # Runs when the RPC ends for any reason; a stream that did not finish lost its puller
        # (the handler may not even be resumed if it was parked at a `yield`).
        self.outcomes.setdefault(request_id, "cancelled")
        self.closed[request_id].set()


async def start_server(servicer: PullKVServicer, host: str = "127.0.0.1") -> tuple[grpc.aio.Server, int]:
    """Start a `grpc.aio` server on an ephemeral port; returns (server, port)."""
    server = grpc.aio.server(options=server_options())
    cbserve_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    return server, port


class PairSetupServicer(PullKVServicer):
    """`PullKVServicer` that also answers `SetupTransport` (collective transport tests)."""

    async def SetupTransport(self, request: cbserve_pb2.SetupTransportRequest,
                             context: grpc.aio.ServicerContext) -> cbserve_pb2.SetupTransportResponse:
        try:
            self.groups[request.group] = await accept_pair(request, device=self.kv.device)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return cbserve_pb2.SetupTransportResponse()
