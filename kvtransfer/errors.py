"""Typed errors of the KV transfer layer.

Every failure a pod must react to has its own type, so the pods can map them onto gRPC status
codes and engine events without parsing messages:

- `LayoutError`: the two sides disagree on what a block is (shape, dtype, sizes, block counts).
  Pods answer with `FAILED_PRECONDITION` / `INVALID_ARGUMENT`.
- `ChecksumError`: a chunk's bytes do not match its crc32. The transfer is refused.
- `ProtocolError`: a well-formed chunk arrived where it must not (out of order, duplicate,
  after `last`, wrong request id) or the stream ended without `last` (`StreamEndedError`).
- `SourceLostError`: the prefill side went away (gRPC error, process group broken, timeout).
  The decode pod falls back to a local prefill or fails the request.
- `SourceAbortedError`: the prefill engine gave up on the request (aborted, preempted).
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Base class of every error raised by `kvtransfer`."""


class LayoutError(KVTransferError, ValueError):
    """Source and destination disagree on block layout, sizes or counts."""


class ChecksumError(KVTransferError):
    """A chunk's bytes do not match the crc32 it carries."""


class ProtocolError(KVTransferError):
    """A chunk arrived that the stream's state does not allow (order, duplicates, ids)."""


class StreamEndedError(ProtocolError):
    """The chunk stream ended before the message marked `last` arrived."""


class SourceLostError(KVTransferError):
    """The peer is gone: transport error, broken process group, or a timeout.

    `code` is the gRPC status code name when the error came from gRPC (e.g. "UNAVAILABLE",
    "CANCELLED", "DEADLINE_EXCEEDED"), else "".
    """

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class SourceAbortedError(KVTransferError):
    """The prefill engine gave up on the request before its KV was complete."""
