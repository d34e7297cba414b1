"""The KV stream of `PrefillService.PullKV`: `KVSource` on the prefill pod, `KVSink` on the
decode pod.

Source (prefill pod, inside the `PullKV` handler; `kvtransfer.testing.PullKVServicer` is a
runnable version)::

    async def PullKV(self, request, context):
        if problem := check_compatible(self.model_info, request.model):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        progress = self.progress_of(request.request_id)  # KVProgress fed by the engine; the
        self.held.take(request.request_id)               # pull now owns any held blocks
        context.add_done_callback(lambda _: self.release(request.request_id))  # the lease
        group = self.groups[request.nccl_group] if request.transport == "nccl" else None
        source = KVSource(self.kv, request.request_id, progress.num_prompt_tokens,
                          max_chunk_bytes=request.max_chunk_bytes, group=group)
        async for chunk in source.chunks(progress.events()):
            yield chunk

  The open stream is the lease: when the decode pod cancels, dies (TCP reset, or keepalive after
  `grpc_options.KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS`) or the deadline passes, the handler
  task is cancelled (`asyncio.CancelledError` at its current `await`/`yield`) and the context's
  done callbacks run at once; release the blocks there. `SourceAbortedError` (engine gave up)
  should become `ABORTED`, `LayoutError` `INVALID_ARGUMENT`.

Sink (decode pod, after reserving `dst_block_ids`)::

    sink = KVSink(kv, dst_block_ids, request_id, num_prompt_tokens, group=...)
    result = await pull_kv(stub, PullKVRequest(...), sink, timeout=deadline_left)

  `pull_kv` raises `SourceLostError` (prefill pod gone: fall back to a local prefill),
  `LayoutError` (`FAILED_PRECONDITION` from the source, or sizes that do not add up),
  `ChecksumError`, `ProtocolError`; on any error it cancels the call so the source learns of it.

Message rules (both sides): chunks arrive in block order with no gap or repeat; each carries
whole blocks; the partial last block goes out only with the message marked `last`, which carries
the first token (it may carry no blocks). For transport "nccl" `data` is empty and `crc32` is 0:
the run's bytes follow on the pair's process group (`kvtransfer.collective`). A source given a
draft model's cache (`draft_kv=`) sends the same run of the draft's blocks with every run, in
`draft_data` (or after the target's bytes on the group), and marks every message `draft_kv`; a
sink given one writes them into the same destination blocks of it (`kvtransfer.draft_kv`).
A cache with KV groups (`kvtransfer.kv_groups`) streams each group's pages in block order from
that group's start, in messages tagged `kv_group`; the `last` message follows every group's pages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from wire import cbserve_pb2
from kvtransfer.draft_kv import draft_stream_id
from kvtransfer.errors import (ChecksumError, LayoutError, ProtocolError, SourceAbortedError,
                               SourceLostError, StreamEndedError)
from kvtransfer.kv_groups import group_stream_id
from kvtransfer.layout import KVLayout
from kvtransfer.packing import (Run, checksum, plan_runs, resolve_max_chunk_bytes, run_bytes,
                                run_tensor, scatter_blocks, write_run)
from kvtransfer.progress import ComputedTokens, FirstToken, KVEvent

NULL_BLOCK_ID = 0   # engine.block_pool's null block: what a table holds where a block was freed

if TYPE_CHECKING:
    from kvtransfer.collective import PairGroup


class KVSource:
    """Turns prefill progress events into the `KVChunk` messages of one `PullKV` stream."""

    def __init__(self, kv: torch.Tensor, request_id: str, num_prompt_tokens: int, *,
                 max_chunk_bytes: int = 0, group: PairGroup | None = None,
                 start_block_index: int = 0, layout: KVLayout | None = None,
                 read_blocks: Callable[[Sequence[int]], torch.Tensor] | None = None,
                 draft_kv: torch.Tensor | None = None,
                 group_start_block_indices: Sequence[int] = ()) -> None:
        """`kv`: the engine's KV tensor; `max_chunk_bytes`: payload cap per message (0 = default,
        see `packing.resolve_max_chunk_bytes`); `group`: send the bytes over this process group
        instead of in the messages; `start_block_index`: skip the first blocks (no query of the
        puller reads them: they are behind every layer's window; the table may change there, as
        they are freed). `read_blocks(ids)` with `layout`: where `kv` holds only part of each
        block (a tensor-parallel rank), the whole blocks come from it (a CPU tensor in `layout`). `draft_kv`: a
        draft model's cache, whose same blocks travel with each run (`kvtransfer.draft_kv`).
        `group_start_block_indices`: a cache with KV groups (`kvtransfer.kv_groups`): where each
        of groups 1.. starts (its window's start); the events then carry those groups' tables."""
        if read_blocks is not None and group is not None:
            raise LayoutError("gathered KV blocks (tensor parallelism) travel over gRPC only")
        if draft_kv is not None and group_start_block_indices:
            raise LayoutError("a draft model's KV travels with a single-group cache only")
        self.layout = layout or KVLayout.from_tensor(kv)
        self.read_blocks = read_blocks
        if num_prompt_tokens <= 0:
            raise LayoutError(f"num_prompt_tokens must be positive, got {num_prompt_tokens}")
        self.kv = kv
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.max_chunk_bytes = resolve_max_chunk_bytes(max_chunk_bytes, self.layout)
        self.draft_kv = draft_kv
        self.draft_layout = None if draft_kv is None else KVLayout.from_tensor(draft_kv)
        self.group = group
        self.start_block_index = start_block_index
        # Per KV group (one for a single-group cache): where it starts, what was sent, its table.
        self.starts = (start_block_index, *group_start_block_indices)
        self._sent = list(self.starts)
        self._tables: list[tuple[int, ...]] = [()] * len(self.starts)
        self.num_bytes_sent = 0
        self._pending_send: list[concurrent.futures.Future] = []
        self._staging = (torch.empty(self.max_chunk_bytes, dtype=torch.uint8, pin_memory=True)
                         if kv.is_cuda and group is None else None)
        self._draft_staging = (torch.empty(max(self.max_chunk_bytes, self.draft_layout.bytes_per_block),
                                           dtype=torch.uint8, pin_memory=True)
                               if draft_kv is not None and draft_kv.is_cuda and group is None else None)

    @property
    def num_blocks_sent(self) -> int:
        """Group 0's table index the next message starts at."""
        return self._sent[0]

    async def chunks(self, events: AsyncIterable[KVEvent]) -> AsyncIterator[cbserve_pb2.KVChunk]:
        """Yield a message for every block that became full, in order; end with `last`.

        Raises `SourceAbortedError` when the events end without a first token, `LayoutError` when
        the events contradict the request (block table rewritten, too few blocks).
        """
        # A message holds whole blocks of both caches (at least one of each, whatever the cap).
        block_bytes = self.layout.bytes_per_block + (self.draft_layout.bytes_per_block if self.draft_layout else 0)
        max_blocks = max(1, self.max_chunk_bytes // block_bytes)
        total_blocks = self.layout.num_blocks_for(self.num_prompt_tokens)
        async for event in events:
            self._accept_block_ids(event)
            if isinstance(event, ComputedTokens):
                ready = min(event.num_computed_tokens // self.layout.block_size, total_blocks)
                async for chunk in self._emit(self._plan(ready, max_blocks), final=None):
                    yield chunk
            elif isinstance(event, FirstToken):
                runs = self._plan(total_blocks, max_blocks)
                # The last message may carry no blocks: it still carries the first token.
                async for chunk in self._emit(runs or [(0, Run(self._sent[0], 0, 0))], final=event):
                    yield chunk
                return
        raise SourceAbortedError(f"request {self.request_id}: prefill ended without a first token")

    def _plan(self, ready: int, max_blocks: int) -> list[tuple[int, Run]]:
        """Every group's runs up to block `ready`, group by group (each in block order)."""
        runs = []
        for g, table in enumerate(self._tables):
            self._require_blocks(g, ready)
            runs += [(g, run) for run in plan_runs(table, self._sent[g], ready, max_blocks)]
        return runs

    async def _emit(self, runs: list[tuple[int, Run]],
                    final: FirstToken | None) -> AsyncIterator[cbserve_pb2.KVChunk]:
        """One message per (group, run); `final` goes on the last. Packing (copy + crc, in a
        worker thread) of run k+1 overlaps the sending of run k."""
        packing = self._start_pack(runs[0][1]) if runs else None
        try:
            for k, (g, run) in enumerate(runs):
                packed = await packing
                packing = self._start_pack(runs[k + 1][1]) if k + 1 < len(runs) else None
                yield self._message(g, run, packed, final if k == len(runs) - 1 else None)
                await self._drain()
        finally:
            if packing is not None:
                packing.cancel()

    def _start_pack(self, run: Run) -> asyncio.Future[tuple[bytes, int, bytes, int]]:
        """The run's bytes and crc32 in the target's cache, then in the draft's (empty without one)."""
        if self.group is not None or not run.num_blocks:
            done: asyncio.Future[tuple[bytes, int, bytes, int]] = asyncio.get_running_loop().create_future()
            done.set_result((b"", 0, b"", 0))
            return done
        # Copy + crc of up to max_chunk_bytes: off the event loop, which serves other streams.
        return asyncio.ensure_future(asyncio.to_thread(self._pack, run))

    def _accept_block_ids(self, event: KVEvent) -> None:
        tables = (event.block_ids, *event.group_block_ids)
        if len(tables) != len(self._tables):
            raise LayoutError(f"request {self.request_id}: the prefill reports {len(tables)} KV group "
                              f"table(s), the stream sends {len(self._tables)}")
        for g, block_ids in enumerate(tables):
            # Blocks already shipped must never move: the receiver holds copies of them.
            start, old = self.starts[g], self._tables[g]
            sent = min(self._sent[g], len(old))
            if len(block_ids) < sent or tuple(block_ids[start:sent]) != old[start:sent]:
                raise LayoutError(f"request {self.request_id}: block table changed under a streaming "
                                  f"transfer ({sent} blocks already sent)")
            self._tables[g] = tuple(block_ids)

    def _require_blocks(self, g: int, num_blocks: int) -> None:
        table, sent = self._tables[g], self._sent[g]
        if len(table) < num_blocks:
            raise LayoutError(f"request {self.request_id}: {num_blocks} blocks are computed but the "
                              f"block table lists {len(table)}")
        # Block 0 is the engine's null block: an entry freed behind a window. Sending it would
        # hand the puller junk as KV (which it would cache under the prompt's real hash).
        if NULL_BLOCK_ID in table[sent:num_blocks]:
            raise LayoutError(f"request {self.request_id}: blocks from {sent} on were "
                              "freed behind the sliding window here but the puller asks for them")

    def _message(self, g: int, run: Run, packed: tuple[bytes, int, bytes, int],
                 final: FirstToken | None) -> cbserve_pb2.KVChunk:
        data, crc, draft_data, draft_crc = packed
        num_bytes = run.num_blocks * self.layout.bytes_per_block
        end_index = run.first_block_index + run.num_blocks
        chunk = cbserve_pb2.KVChunk(
            request_id=self.request_id, first_block_index=run.first_block_index,
            num_blocks=run.num_blocks, data=data, crc32=crc,
            num_prompt_tokens=self.num_prompt_tokens,
            num_computed_tokens=min(end_index * self.layout.block_size, self.num_prompt_tokens),
            num_bytes=num_bytes, kv_group=g,
        )
        if self.draft_kv is not None:
            chunk.draft_kv, chunk.draft_data, chunk.draft_crc32 = True, draft_data, draft_crc
            self.num_bytes_sent += run.num_blocks * self.draft_layout.bytes_per_block
        if final is not None:
            chunk.last = True
            chunk.first_token_id = final.token_id
            chunk.grammar_fingerprint = final.grammar_fingerprint
            if final.logprobs is not None:
                chunk.first_token_logprobs.CopyFrom(final.logprobs)
            if final.prompt_logprobs is not None:
                chunk.prompt_logprobs.CopyFrom(final.prompt_logprobs)
        if self.group is not None and run.num_blocks:
            # Queue the bytes before the metadata leaves, so that they go out even if this
            # generator is cancelled at the yield (the receiver drops runs nobody claims);
            # `_drain` waits for them after the yield, which paces the stream.
            self._pending_send.append(self.group.submit_send(
                group_stream_id(self.request_id, g), run.first_block_index, run_tensor(self.kv, run)))
            if self.draft_kv is not None:
                self._pending_send.append(self.group.submit_send(
                    draft_stream_id(self.request_id), run.first_block_index, run_tensor(self.draft_kv, run)))
        self._sent[g] = end_index
        self.num_bytes_sent += num_bytes
        return chunk

    async def _drain(self) -> None:
        pending, self._pending_send = self._pending_send, []
        for future in pending:
            await asyncio.wrap_future(future)

    def _pack(self, run: Run) -> tuple[bytes, int, bytes, int]:
        if self.read_blocks is not None:
            blocks = self.read_blocks(range(run.first_block_id, run.first_block_id + run.num_blocks))
            view = memoryview(blocks.reshape(-1).view(torch.uint8).numpy())
        else:
            view = run_bytes(self.kv, run, self._staging)
        data, crc = bytes(view), checksum(view)
        if self.draft_kv is None:
            return data, crc, b"", 0
        # The draft runs unsharded on rank 0: its blocks are whole here even under tensor parallelism.
        draft = run_bytes(self.draft_kv, run, self._draft_staging)
        return data, crc, bytes(draft), checksum(draft)


@dataclass(frozen=True)
class KVTransferResult:
    """What the decode pod needs once the last chunk has landed."""

    first_token_id: int
    first_token_logprobs: cbserve_pb2.TokenLogprobs | None
    num_blocks: int   # blocks written (with KV groups: pages, every group's)
    num_bytes: int
    seconds: float  # first message received -> last written
    grammar_fingerprint: str = ""   # structured output: what the first token was sampled under
    prompt_logprobs: cbserve_pb2.PromptLogprobs | None = None
    draft_kv: bool = False          # the draft model's KV of the prompt landed too (`kvtransfer.draft_kv`)


class KVSink:
    """Receives one request's `KVChunk` stream into reserved destination blocks."""

    def __init__(self, kv: torch.Tensor, dst_block_ids: Sequence[int], request_id: str,
                 num_prompt_tokens: int, *, group: PairGroup | None = None,
                 recv_timeout_s: float = 30.0, layout: KVLayout | None = None,
                 write_blocks: Callable[[Sequence[int], torch.Tensor], None] | None = None,
                 start_block_index: int = 0, draft_kv: torch.Tensor | None = None,
                 group_dst_block_ids: Sequence[Sequence[int]] = (),
                 group_start_block_indices: Sequence[int] = ()) -> None:
        """`dst_block_ids`: the blocks reserved for the prompt (at least
        `ceil(num_prompt_tokens / block_size)` entries; those before `start_block_index`, the
        blocks the source skips (`KVSource`), are not written); `group`: receive the bytes from
        this process group (transport "nccl"); `recv_timeout_s`: bound on waiting for a run's bytes there.
        `write_blocks(ids, blocks)` with `layout`: where `kv` holds only part of each block (a
        tensor-parallel rank), whole blocks in `layout` go to it after the crc check. `draft_kv`:
        this pod's draft model's cache, where the draft's blocks go if the source ships them
        (`kvtransfer.draft_kv`; then into the same destination blocks). `group_dst_block_ids`
        and `group_start_block_indices`: a cache with KV groups (`kvtransfer.kv_groups`): the
        reserved tables of groups 1.. and where the source starts each of them."""
        if write_blocks is not None and group is not None:
            raise LayoutError("scattered KV blocks (tensor parallelism) travel over gRPC only")
        if len(group_dst_block_ids) != len(group_start_block_indices):
            raise LayoutError(f"request {request_id}: {len(group_dst_block_ids)} KV group tables for "
                              f"{len(group_start_block_indices)} group starts")
        if draft_kv is not None and group_dst_block_ids:
            raise LayoutError("a draft model's KV travels with a single-group cache only")
        self.layout = layout or KVLayout.from_tensor(kv)
        self.write_blocks = write_blocks
        self.num_blocks_expected = self.layout.num_blocks_for(num_prompt_tokens)
        self.dst = [list(dst_block_ids), *map(list, group_dst_block_ids)]   # per KV group
        self.starts = (start_block_index, *group_start_block_indices)
        for dst, start in zip(self.dst, self.starts):
            if num_prompt_tokens <= 0 or len(dst) < self.num_blocks_expected:
                raise LayoutError(f"request {request_id}: {len(dst)} destination blocks "
                                  f"cannot hold {num_prompt_tokens} prompt tokens")
            if not 0 <= start < self.num_blocks_expected:
                raise LayoutError(f"request {request_id}: start block {start} outside the "
                                  f"prompt's {self.num_blocks_expected} blocks")
        self.start_block_index = start_block_index
        self.kv = kv
        self.dst_block_ids = self.dst[0]
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.group = group
        self.recv_timeout_s = recv_timeout_s
        self._received = list(self.starts)   # per group: the table index its next chunk starts at
        self.num_bytes_received = 0
        self.num_computed_tokens = 0  # prompt tokens whose KV has landed (group 0)
        self._staging: torch.Tensor | None = None
        self.draft_kv = draft_kv
        self.draft_layout = None if draft_kv is None else KVLayout.from_tensor(draft_kv)
        self.draft_shipped: bool | None = None   # the first chunk says; every other must agree
        if group is not None:
            for stream_id in self._stream_ids():   # before the stream opens: its first run may come first
                group.expect(stream_id)

    @property
    def num_blocks_received(self) -> int:
        """Group 0's table index the next chunk starts at."""
        return self._received[0]

    def _stream_ids(self) -> list[str]:
        ids = [group_stream_id(self.request_id, g) for g in range(len(self.dst))]
        return ids + ([draft_stream_id(self.request_id)] if self.draft_kv is not None else [])

    async def consume(self, chunks: AsyncIterable[cbserve_pb2.KVChunk]) -> KVTransferResult:
        """Write every chunk into the destination blocks; return at the `last` message."""
        started: float | None = None
        try:
            async for chunk in chunks:
                started = started or time.perf_counter()
                await self._accept(chunk)
                if chunk.last:
                    return self._finish(chunk, time.perf_counter() - started)
        finally:
            if self.group is not None:
                for stream_id in self._stream_ids():
                    self.group.forget(stream_id)
        raise StreamEndedError(f"request {self.request_id}: KV stream ended after "
                               f"{self.num_blocks_received}/{self.num_blocks_expected} blocks "
                               "without its last message")

    async def _accept(self, chunk: cbserve_pb2.KVChunk) -> None:
        if chunk.request_id != self.request_id:
            raise ProtocolError(f"chunk for request {chunk.request_id!r} on the stream of "
                                f"{self.request_id!r}")
        g = chunk.kv_group
        if not 0 <= g < len(self.dst):
            raise ProtocolError(f"request {self.request_id}: chunk for KV group {g}, this pod has "
                                f"{len(self.dst)} group(s)")
        if chunk.first_block_index != self._received[g]:
            kind = "duplicate" if chunk.first_block_index < self._received[g] else "gap"
            where = f" (KV group {g})" if len(self.dst) > 1 else ""
            raise ProtocolError(f"request {self.request_id}: {kind}: chunk starts at block "
                                f"{chunk.first_block_index}, expected {self._received[g]}{where}")
        if chunk.num_prompt_tokens != self.num_prompt_tokens:
            raise LayoutError(f"request {self.request_id}: source has {chunk.num_prompt_tokens} "
                              f"prompt tokens, destination expects {self.num_prompt_tokens}")
        end = chunk.first_block_index + chunk.num_blocks
        if chunk.num_blocks < 0 or end > self.num_blocks_expected:
            raise LayoutError(f"request {self.request_id}: chunk blocks {chunk.first_block_index}"
                              f"..{end} exceed the prompt's {self.num_blocks_expected} blocks")
        num_bytes = chunk.num_blocks * self.layout.bytes_per_block
        if chunk.num_bytes != num_bytes:
            raise LayoutError(f"request {self.request_id}: chunk says {chunk.num_bytes} bytes for "
                              f"{chunk.num_blocks} blocks of {self.layout.bytes_per_block}")
        dst = self.dst[g][chunk.first_block_index:end]
        if self.write_blocks is not None:
            if len(chunk.data) != num_bytes:
                raise LayoutError(f"request {self.request_id}: chunk has {len(chunk.data)} bytes, expected {num_bytes}")
            if (actual := checksum(chunk.data)) != chunk.crc32:
                raise ChecksumError(f"crc32 mismatch: payload has {actual:#010x}, message says {chunk.crc32:#010x}")
            blocks = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8).view(self.layout.dtype) \
                .view(chunk.num_blocks, *self.layout.block_shape)
            await asyncio.to_thread(self.write_blocks, dst, blocks)
        elif self.group is None:
            await asyncio.to_thread(write_run, self.kv, dst, chunk.data, chunk.crc32,
                                    staging=self._host_staging(num_bytes))
        elif chunk.num_blocks:
            if chunk.data:
                raise ProtocolError(f"request {self.request_id}: bytes in a chunk of a "
                                    "process-group transfer")
            payload = await self._recv_run(group_stream_id(self.request_id, g), chunk.first_block_index, num_bytes)
            await asyncio.to_thread(scatter_blocks, self.kv, dst, payload)
        if self._draft_shipped(chunk) and chunk.num_blocks:
            await self._accept_draft(chunk, dst)
        self._received[g] = end
        self.num_bytes_received += num_bytes
        if g == 0:
            self.num_computed_tokens = min(end * self.layout.block_size, self.num_prompt_tokens)

    def _draft_shipped(self, chunk: cbserve_pb2.KVChunk) -> bool:
        if self.draft_shipped is None:
            if chunk.draft_kv and self.draft_kv is None:
                raise ProtocolError(f"request {self.request_id}: draft KV in the stream of a pod without a draft")
            self.draft_shipped = chunk.draft_kv
        elif chunk.draft_kv != self.draft_shipped:
            raise ProtocolError(f"request {self.request_id}: draft KV in some chunks of the stream, not all")
        return self.draft_shipped

    async def _accept_draft(self, chunk: cbserve_pb2.KVChunk, dst: list[int]) -> None:
        """The draft's blocks of the chunk's run, into the same destination blocks of its cache."""
        num_bytes = chunk.num_blocks * self.draft_layout.bytes_per_block
        if self.group is None:
            await asyncio.to_thread(write_run, self.draft_kv, dst, chunk.draft_data, chunk.draft_crc32,
                                    staging=self._host_staging(num_bytes))
        else:
            payload = await self._recv_run(draft_stream_id(self.request_id), chunk.first_block_index, num_bytes)
            await asyncio.to_thread(scatter_blocks, self.draft_kv, dst, payload)
        self.num_bytes_received += num_bytes

    async def _recv_run(self, stream_id: str, first_block_index: int, num_bytes: int) -> torch.Tensor:
        try:
            return await asyncio.wait_for(self.group.recv_run(stream_id, first_block_index, num_bytes),
                                          self.recv_timeout_s)
        except asyncio.TimeoutError:
            raise SourceLostError(f"request {self.request_id}: the bytes of block {first_block_index} did not "
                                  f"arrive on pair {self.group.group_name} within {self.recv_timeout_s} s",
                                  "DEADLINE_EXCEEDED") from None

    def _host_staging(self, num_bytes: int) -> torch.Tensor | None:
        """A pinned host buffer for host -> device copies (CUDA caches only), grown on demand."""
        if not self.kv.is_cuda:
            return None
        if self._staging is None or self._staging.numel() < num_bytes:
            self._staging = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        return self._staging

    def _finish(self, chunk: cbserve_pb2.KVChunk, seconds: float) -> KVTransferResult:
        for g, received in enumerate(self._received):
            if received != self.num_blocks_expected:
                where = f" of KV group {g}" if len(self.dst) > 1 else ""
                raise ProtocolError(f"request {self.request_id}: last message after "
                                    f"{received}/{self.num_blocks_expected} blocks{where}")
        logprobs = chunk.first_token_logprobs if chunk.HasField("first_token_logprobs") else None
        prompt = chunk.prompt_logprobs if chunk.HasField("prompt_logprobs") else None
        num_pages = sum(self.num_blocks_expected - start for start in self.starts)
        return KVTransferResult(chunk.first_token_id, logprobs, num_pages,
                                self.num_bytes_received, seconds, chunk.grammar_fingerprint, prompt,
                                draft_kv=bool(self.draft_shipped))


FINISH_GRACE_SECONDS = 1.0


async def pull_kv(stub, request: cbserve_pb2.PullKVRequest, sink: KVSink, *,
                  timeout: float | None = None) -> KVTransferResult:
    """Open `PullKV` on a `PrefillServiceStub` and feed it to `sink`, with typed errors.

    Status codes from the source map to: FAILED_PRECONDITION / INVALID_ARGUMENT -> `LayoutError`,
    ABORTED -> `SourceAbortedError`, anything else (UNAVAILABLE, NOT_FOUND, DEADLINE_EXCEEDED,
    CANCELLED, ...) -> `SourceLostError` with `.code` set. The sink's own checks raise
    `ChecksumError` / `ProtocolError` / `LayoutError`. Any failure cancels the call, so the
    prefill pod learns at once and releases the blocks.
    """
    call = stub.PullKV(request, timeout=timeout)
    try:
        result = await sink.consume(call)
        # Let the source end the stream itself (status OK) so it counts a clean finish; the KV
        # is complete already, so a source that lingers is only cut off, not waited for.
        try:
            await asyncio.wait_for(call.code(), FINISH_GRACE_SECONDS)
        except asyncio.TimeoutError:
            call.cancel()
        return result
    except grpc.aio.AioRpcError as error:
        call.cancel()
        code = error.code()
        message = f"PullKV {request.request_id}: {code.name}: {error.details()}"
        if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
            raise LayoutError(message) from error
        if code == grpc.StatusCode.ABORTED:
            raise SourceAbortedError(message) from error
        raise SourceLostError(message, code.name) from error
    except BaseException:
        # Refused chunk, cancellation, deadline: end the stream now so the source stops.
        # (After `last` the source ends the stream itself, and sees it finish normally.)
        call.cancel()
        raise
