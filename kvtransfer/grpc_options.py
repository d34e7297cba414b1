"""gRPC channel and server options for every channel and server in cbserve (pods and router).

The message limit bounds one `KVChunk`; `MAX_CHUNK_BYTES` leaves room for the chunk's other
fields. Keepalive pings make a silently vanished or frozen peer (node lost, SIGSTOP, no TCP
reset) visible within `KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS` (~8 s; measured 7 s for a call
started on a SIGSTOPped server, `tests/kvtransfer/test_keepalive.py`), for every call on the
channel, unary ones included: the open `PullKV` stream is the lease on the prefill pod's blocks,
and a request routed to a frozen pod must fail over in seconds, not minutes.

Why `ping_timeout_ms`: gRPC core sends a keepalive ping only when no other ping is outstanding,
and a ping it sent for another reason (flow-control probing as a call starts) waits for its ack
for `ping_timeout_ms`, one minute by default, whatever `keepalive_timeout_ms` says. Without it a
frozen peer was noticed after 62-69 s.
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

KEEPALIVE_TIME_MS = 3_000       # a ping every 3 s on every connection, busy or idle
KEEPALIVE_TIMEOUT_MS = 5_000    # an unanswered ping for 5 s closes the connection (UNAVAILABLE)
# A channel whose peer is down retries connecting with backoff; the default grows to 2 minutes, so
# a pod restarted at the same address (`cbserve up`, a rescheduled pod) would wait that long.
MAX_RECONNECT_BACKOFF_MS = 2_000
# Servers accept pings this often (a client pinging faster than this is not an attack to refuse).
MIN_RECV_PING_INTERVAL_MS = 1_000


def channel_options() -> list[tuple[str, int]]:
    """Options for `grpc.aio.insecure_channel(address, options=channel_options())`."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        # 0: keep pinging however long no data flows (the default stops after 2 pings, so a
        # stream waiting on a frozen peer's next message would never notice it).
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


def server_options() -> list[tuple[str, int]]:
    """Options for `grpc.aio.server(options=server_options())`.

    The listening port is exclusive (no SO_REUSEPORT): a pod never shares its address with another.

    The server pings its clients too (a decode pod that vanished must release its lease), and
    accepts the clients' pings at the rate `channel_options` sends them, with or without calls
    (a client's pings never count as strikes, so no GOAWAY "too_many_pings").
    """
    return channel_options() + [
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_RECV_PING_INTERVAL_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_RECV_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),
        # gRPC sets SO_REUSEPORT by default: a second pod told to listen on a port another pod
        # serves would bind it too, and the kernel would split new connections between the two
        # processes (a decode pod's PullKV could reach another pod's request of the same id:
        # issue 11 case 7). A taken port must fail the pod's start instead.
        ("grpc.so_reuseport", 0),
    ]
