"""What a pull moves of a cache with KV groups (a mixed local/global model: `engine.kv_groups`).

Such a cache holds pages of `slots` layers, and a request has one table per group: group 0 (the
full layers) a page for every block of the prompt, each windowed group a page only for the
blocks its window still reaches. The decode pod's first query (position P, the prompt's length)
reads, in a group of window w, keys from `P - w + 1` on, so a pull moves group 0's pages of every
block and group g's pages from `floor((P - w_g + 1) / block_size)` on (`GroupTables.
first_blocks_in_window`); nothing before that index is freed on the prefill pod while the pull
streams (it frees only behind its own earlier positions), and the decode pod reserves nothing
there. Each group's pages travel as the single-group cache's blocks do (coalesced runs in block
order), in messages tagged `KVChunk.kv_group`; on a process group each group's runs go under
their own stream id, since frames are keyed by (stream, block index). Both pods derive every
start from the windows and block size that the handshake compared (`ModelInfo.kv_group_windows`,
`kv_page_slots`).
"""

from __future__ import annotations

# Frames of group g > 0 go under this id (group 0 keeps the request id: a single-group stream's).
_GROUP_SUFFIX = "\x00kv"


def group_stream_id(request_id: str, group: int) -> str:
    return request_id if group == 0 else f"{request_id}{_GROUP_SUFFIX}{group}"
