"""Reading a request body with bounded work: a size cap while it streams in, a cap on its JSON
containers before it is parsed.

Both run before any other work on the request, on the event loop, so each is linear in the
bytes received with a small constant:
- the size cap answers 413 from `Content-Length` alone, and otherwise counts bytes as they
  arrive, so a 50 MB body is never held in memory (a chunked body has no `Content-Length`);
- JSON parsing is the next cost, and it grows with the number of arrays and objects more than
  with bytes: 16 MiB of `[1],` is four million lists, seconds of the GIL inside pydantic. No
  valid request needs more than a few thousand (every list field is capped), so a body with
  more than `MAX_JSON_CONTAINERS` is refused before it is parsed.
"""

from __future__ import annotations

import re

from fastapi import Request

from router.errors import APIError, bad_request

MAX_JSON_CONTAINERS = 1 << 16
# A JSON string, escapes included ("unrolled" so the regex engine runs the common case in one loop).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def body_too_large(limit: int, size: int | None = None) -> APIError:
    got = f" (got {size} bytes)" if size is not None else ""
    return APIError(413, f"Request body is larger than {limit} bytes{got}; see --max-request-body-bytes.",
                    code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 once it is known to exceed `limit` bytes.

    A client that disconnects mid-body raises starlette's `ClientDisconnect` (the app logs it
    once, at INFO)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit, int(declared))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def count_json_containers(body: bytes) -> int:
    """Arrays and objects in `body`, brackets inside strings not counted.

    The raw byte count is an upper bound found at C speed; only a body above the limit by that
    bound pays for removing its strings (one regex pass) to count exactly."""
    rough = body.count(b"[") + body.count(b"{")
    if rough <= MAX_JSON_CONTAINERS:
        return rough
    structure = _JSON_STRING.sub(b"", body)
    return structure.count(b"[") + structure.count(b"{")


def check_json_containers(body: bytes) -> None:
    """400 when the body holds more JSON arrays and objects than any valid request needs."""
    count = count_json_containers(body)
    if count > MAX_JSON_CONTAINERS:
        raise bad_request(f"The request body has {count} JSON arrays and objects; at most "
                          f"{MAX_JSON_CONTAINERS} are accepted.", code="request_too_complex")
