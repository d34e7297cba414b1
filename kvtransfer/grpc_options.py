"""gRPC channel and server options for KV streams (use them on both pods).

The message limit bounds one `KVChunk`; `MAX_CHUNK_BYTES` leaves room for the chunk's other
fields. Keepalive pings make a silently vanished peer (node lost, no TCP reset) visible within
`KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS`, because the open `PullKV` stream is the lease on the
prefill pod's blocks and must not outlive its holder by minutes.
"""

from __future__ import annotations

MIB = 1 << 20

# Largest gRPC message either side accepts (send and receive).
MAX_MESSAGE_BYTES = 64 * MIB
# Largest `data` payload of one KVChunk; the headroom covers the other fields (ids, logprobs).
MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - MIB
# Payload cap when the puller leaves PullKVRequest.max_chunk_bytes at 0. 4 MiB keeps the first
# chunk's latency low and still amortises per-message costs (see bench/kv_transfer.py).
DEFAULT_MAX_CHUNK_BYTES = 4 * MIB

KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000


def channel_options() -> list[tuple[str, int]]:
    """Options for `grpc.aio.insecure_channel(address, options=channel_options())`."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options() -> list[tuple[str, int]]:
    """Options for `grpc.aio.server(options=server_options())`.

    The listening port is exclusive (no SO_REUSEPORT): a pod never shares its address with another.

    The server pings its clients too (a decode pod that vanished must release its lease), and
    accepts the clients' pings at the rate `channel_options` sends them.
    """
    return channel_options() + [
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        # gRPC sets SO_REUSEPORT by default: a second pod told to listen on a port another pod
        # serves would bind it too, and the kernel would split new connections between the two
        # processes (a decode pod's PullKV could reach another pod's request of the same id:
        # issue 11 case 7). A taken port must fail the pod's start instead.
        ("grpc.so_reuseport", 0),
    ]
