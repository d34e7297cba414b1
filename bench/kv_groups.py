"""KV held by one long chat on a mixed local/global model, one KV group vs a table per group.

    python bench/kv_groups.py                                   # Gemma 3 27B and gpt-oss 20b shapes
    python bench/kv_groups.py --contexts 8192 --memory-gib 20

Runs the engine's own scheduler and KV cache manager (no model: the KV accounting does not
depend on the weights) on a chat that grows turn by turn: each turn's prompt is the whole
conversation so far plus a new user message (a prefix-cache hit on the last turn), then an
answer. Two arms on the same KV memory:
  one group   every block holds every layer's KV and stays until the request ends (before:
              the global layers read every block, so nothing was freed)
  groups      a table per KV group (engine/kv_groups/): the local groups free their pages
              behind the window, the full group keeps every block
It prints, for each context the chat reaches, the KV bytes the chat's last turn holds at its
peak (pages x page bytes), their ratio, and how many such chats fit in `--memory-gib` at once.
Bytes are exact counts, not timings: the machine's load does not move them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from engine.kv_groups.spec import KVGroups  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402
from engine.scheduling.scheduler import Scheduler  # noqa: E402

GiB = 1 << 30
# name: (layer windows, kv heads, head dim): bf16 KV.
SHAPES = {
    "gemma3-27b": (tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(62)), 16, 128),
    "gpt-oss-20b": ((128, 0) * 12, 8, 64),
}


def peak_bytes(windows: tuple[int, ...], kv_heads: int, head_dim: int, context: int, turn: int, answer: int,
               block_size: int, grouped: bool, memory: int) -> tuple[int, int]:
    """(peak KV bytes of the chat's last turn, page bytes) for a chat reaching `context` tokens."""
    groups = KVGroups.for_windows(windows, len(windows)) if grouped else KVGroups.single(len(windows))
    page_bytes = groups.slots * 2 * block_size * kv_heads * head_dim * 2
    cache = CacheConfig(block_size=block_size, num_blocks=memory // page_bytes,
                        kv_group_windows=groups.windows if groups.is_hybrid else ())
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=4, max_model_len=context + turn),
                          cache)
    pool, history, peak, i = scheduler.kv_manager.block_pool, [], 0, 0
    while len(history) + turn + answer <= context:
        history += [(7 * i + j) % 50_000 + 3 for j in range(turn)]
        request = Request(f"turn{i}", list(history), SamplingParams(max_tokens=answer, min_tokens=answer,
                                                                     ignore_eos=True))
        scheduler.add_request(request)
        peak = 0
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            scheduler.update(out, {seq.request_id: (i + len(history)) % 50_000 + 3
                                   for seq in out.scheduled if seq.sample})
            peak = max(peak, pool.num_usable_blocks - pool.num_free_blocks)
        history = list(request.token_ids)
        i += 1
    return peak * page_bytes, page_bytes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--contexts", default="4096,16384,32768", help="comma list: tokens the chat reaches")
    ap.add_argument("--turn", type=int, default=512, help="user tokens per turn")
    ap.add_argument("--answer", type=int, default=512, help="answer tokens per turn")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--memory-gib", type=float, default=40.0, help="KV memory of both arms")
    args = ap.parse_args(argv)
    memory = int(args.memory_gib * GiB)
    print(f"KV a long chat holds at its last turn's peak ({args.turn}-token turns, {args.answer}-token answers, "
          f"bf16, block {args.block_size}, {args.memory_gib:g} GiB of KV)")
    print(f"{'shape':<12} {'context':>8} {'one group MiB':>14} {'groups MiB':>11} {'ratio':>6} "
          f"{'chats fit (one)':>16} {'chats fit (groups)':>19}")
    for name in args.shapes.split(","):
        windows, kv_heads, head_dim = SHAPES[name]
        for context in map(int, args.contexts.split(",")):
            one, _ = peak_bytes(windows, kv_heads, head_dim, context, args.turn, args.answer, args.block_size,
                                False, memory)
            grouped, _ = peak_bytes(windows, kv_heads, head_dim, context, args.turn, args.answer, args.block_size,
                                    True, memory)
            print(f"{name:<12} {context:>8} {one / 2**20:>14.1f} {grouped / 2**20:>11.1f} {one / grouped:>6.2f} "
                  f"{memory // one:>16} {memory // grouped:>19}")


if __name__ == "__main__":
    main()
