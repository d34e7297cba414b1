"""Moving a request's KV-cache blocks from a prefill pod to a decode pod.

Modules (import what you use; this package imports nothing eagerly):

- `layout`: `KVLayout` (what a block is), `check_compatible(local, remote)` for `ModelInfo`.
- `packing`: runs of consecutive blocks, zero-copy byte views, crc32, `write_run`/`scatter_blocks`.
- `progress`: `KVProgress`, the engine thread's "num_computed_tokens advanced / first token"
  events for the asyncio side.
- `grpc_transport`: `KVSource` (prefill: events -> `KVChunk`s), `KVSink` (decode: chunks ->
  blocks), `pull_kv` (client call with typed errors).
- `collective`: `PairGroup`, the Gloo/NCCL byte channel of one prefill/decode pair;
  `pair_setup`: `open_pair` / `accept_pair` over `SetupTransport`.
- `leases`: `HeldKVTable`, prefill-side holds with a TTL.
- `grpc_options`: message limits and keepalive for channels and servers.
- `errors`: the typed errors; `testing`: a PullKV-only servicer for tests and benchmarks.
"""
