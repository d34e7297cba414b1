"""The process-group transport between two real processes on 127.0.0.1 (Gloo)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from wire import cbserve_pb2, cbserve_pb2_grpc
from kvtransfer.collective import PairGroup, host_store, request_key
from kvtransfer.errors import SourceLostError
from kvtransfer.grpc_options import channel_options
from kvtransfer.grpc_transport import KVSink, pull_kv

from kv_helpers import TINY, make_kv, same_bytes
from kv_pair_proc import RUNS, SERVE_IDS

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

SCRIPT = Path(__file__).with_name("kv_pair_proc.py")
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


class PrefillProcess:
    """Rank 0 in a child process; this process hosts the store and is rank 1 (decode side)."""

    def __init__(self, mode: str, group_name: str) -> None:
        self.store = host_store("127.0.0.1", 0)
        self.group_name = group_name
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), str(self.store.port), group_name, mode],
                                     stdout=subprocess.PIPE, text=True, env=ENV)

    async def join(self, timeout_s: float = 3.0, rank: int = 1) -> PairGroup:
        return await PairGroup.create(self.store, self.group_name, rank=rank, backend="gloo",
                                      timeout_s=timeout_s, heartbeat_s=0.2)

    def readline(self) -> str:
        return self.proc.stdout.readline().strip()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_request_key_is_stable_and_63_bit():
    assert request_key("abc") == request_key("abc") != request_key("abd")
    assert 0 <= request_key("x" * 100) < 2**63


def test_runs_of_interleaved_requests_arrive_byte_exact():
    expected = make_kv(TINY, num_blocks=16, seed=1)
    peer = PrefillProcess("runs", "pair-runs")
    try:
        async def receive():
            group = await peer.join()
            # Ask in another order than the sender's: frames are matched by (request, index).
            wanted = sorted(RUNS, reverse=True)
            got = {}
            for request_id, index, first_id, count in wanted[:2]:
                got[(request_id, index)] = await asyncio.wait_for(
                    group.recv_run(request_id, index, count * TINY.bytes_per_block), 10)
            while group.broken is None:  # the sender has sent everything and closed the pair
                await asyncio.sleep(0.01)
            for request_id, index, first_id, count in wanted[2:]:  # arrived before the close
                got[(request_id, index)] = await group.recv_run(
                    request_id, index, count * TINY.bytes_per_block)
            return group, got

        group, got = asyncio.run(receive())
        for request_id, index, first_id, count in RUNS:
            assert same_bytes(got[(request_id, index)], expected[first_id: first_id + count])
        assert peer.proc.wait(timeout=20) == 0
        assert group.broken == "closed by the sender"
    finally:
        peer.stop()


def test_pull_kv_with_bytes_on_the_pair():
    peer = PrefillProcess("serve", "pair-serve")
    try:
        async def pull():
            group = await peer.join()
            port = int(await asyncio.to_thread(peer.readline))
            dst = torch.zeros((16, *TINY.block_shape))
            dst_ids = [15, 14, 1, 2, 3, 7]
            sink = KVSink(dst, dst_ids, "r", 22, group=group)
            request = cbserve_pb2.PullKVRequest(
                request_id="r", model=TINY.to_model_info("tiny", "fp-tiny"), transport="nccl",
                nccl_group="pair-serve", max_chunk_bytes=2 * TINY.bytes_per_block)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
                result = await pull_kv(cbserve_pb2_grpc.PrefillServiceStub(channel), request, sink, timeout=20)
            return dst, dst_ids, result

        dst, dst_ids, result = asyncio.run(pull())
        assert result.first_token_id == 11 and result.num_blocks == 6
        expected = make_kv(TINY, num_blocks=16, seed=1)
        for src_id, dst_id in zip(SERVE_IDS, dst_ids):
            assert same_bytes(expected[src_id], dst[dst_id])
        assert peer.readline() == "finished"
    finally:
        peer.stop()


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_dead_or_hung_peer_raises_within_the_timeout(fault):
    # kill: the connection closes, the error is immediate. stop: the peer is silent (no
    # heartbeats), so the pending receive times out after timeout_s.
    peer = PrefillProcess("hang", f"pair-{fault}")
    try:
        async def wait_for_failure():
            group = await peer.join(timeout_s=2.0)
            assert await asyncio.to_thread(peer.readline) == "sent"
            await group.recv_run("h", 0, 2 * TINY.bytes_per_block)  # the run that did arrive
            os.kill(peer.proc.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises(SourceLostError, match="pair-"):
                await group.recv_run("h", 2, TINY.bytes_per_block)
            elapsed = time.monotonic() - started
            with pytest.raises(SourceLostError, match="broken"):
                await group.recv_run("h", 3, TINY.bytes_per_block)
            return elapsed

        elapsed = asyncio.run(wait_for_failure())
        assert elapsed < (1.0 if fault == "kill" else 5.0)
    finally:
        if fault == "stop":
            os.kill(peer.proc.pid, signal.SIGCONT)
        peer.stop()


def test_sender_learns_that_the_receiver_died():
    peer = PrefillProcess("receiver", "pair-receiver-dies")
    try:
        async def send_until_failure():
            group = await peer.join(timeout_s=2.0, rank=0)
            assert await asyncio.to_thread(peer.readline) == "joined"
            payload = torch.zeros(1 << 20, dtype=torch.uint8)
            await group.send_run("s", 0, payload)  # the receiver drains it
            os.kill(peer.proc.pid, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(SourceLostError, match="send failed"):
                for index in range(1, 100):
                    await group.send_run("s", index, payload)
            return time.monotonic() - started

        assert asyncio.run(send_until_failure()) < 5.0
    finally:
        peer.stop()


def test_backend_must_match_the_device():
    with pytest.raises(ValueError, match="use nccl with CUDA"):
        asyncio.run(PairGroup.create(None, "g", rank=0, backend="gloo", device="cuda"))
