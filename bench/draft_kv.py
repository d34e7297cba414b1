"""P/D with a draft model: prefill the draft on the decode pod, or ship its KV with the target's?

    python bench/draft_kv.py                                  # tiny draft, prompts of 256/1k/4k tokens
    python bench/draft_kv.py --drafts tiny,small --prompt-tokens 256,1024

A decode pod that speculates with a draft model needs the draft's KV of the prompt. Two ways
(issue 25, Deliver 4): the decode pod runs the draft over the prompt it already receives (what
`engine.spec_decode.draft_model` does: the first proposal catches the draft up, chunked under the
step budget), or the prefill pod runs it beside the target's prefill and the draft's KV travels
with the target's. The draft's forward costs the same FLOPs on either pod, so what differs is:
  prefill   the seconds of the draft's prefill on the decode pod (`ModelRunner` over the prompt in
            chunks of `--max-num-batched-tokens`, as the proposer runs it): decode time spent
            once per request, inside one speculative step
  grpc      the seconds the draft's KV adds to the transfer: its bytes pulled through the real
            PullKV server and client on loopback (`bench/kv_transfer.py`'s `bench_grpc`, checksums
            on), which the transfer pays per request on top of the target's KV
and the bytes, both per prompt; medians over `--repeats`. Run it under the exclusive CPU lock.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from bench.kv_transfer import bench_grpc, make_cache
from engine.kv_cache import allocate_kv_cache
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.presets import resolve_model_dir
from engine.scheduling.output import ScheduledSeq
from kvtransfer.layout import KVLayout
from kvtransfer.packing import resolve_max_chunk_bytes

BLOCK = 16


def draft_prefill_seconds(runner: ModelRunner, num_tokens: int, budget: int, vocab: int, repeats: int) -> float:
    """Median seconds of the draft's forwards over a `num_tokens` prompt, `budget` tokens a forward."""
    table = tuple(range(1, -(-num_tokens // BLOCK) + 1))
    prompt = torch.randint(3, vocab, (num_tokens,), generator=torch.Generator().manual_seed(num_tokens)).tolist()
    times = []
    for i in range(repeats + 1):      # the first one warms up (allocator, first touch)
        start = time.perf_counter()
        for begin in range(0, num_tokens, budget):
            end = min(num_tokens, begin + budget)
            runner.run([ScheduledSeq("p", tuple(prompt[begin:end]), begin, table, end == num_tokens)])
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafts", default="tiny", help="presets or checkpoint directories, comma separated")
    parser.add_argument("--prompt-tokens", default="256,1024,4096")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype, cpu = getattr(torch, args.dtype), torch.device("cpu")
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    print(f"torch threads {args.threads}, {args.dtype}, prefill {args.max_num_batched_tokens} tokens a forward; "
          f"medians of {args.repeats}")
    print(f"{'draft':<8} {'tokens':>7} {'KV MiB':>7} {'prefill s':>10} {'grpc s':>8} {'grpc GB/s':>10} "
          f"{'prefill/grpc':>13}")
    for name in args.drafts.split(","):
        path = resolve_model_dir(name)
        cfg = ModelConfig.from_dir(path)
        blocks = -(-max(lengths) // BLOCK) + 1
        runner = ModelRunner(load_model(path, cfg, dtype, cpu, max(lengths) + 1),
                             allocate_kv_cache(cfg, blocks, BLOCK, dtype, cpu), BLOCK, cpu,
                             max_num_seqs=8, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=max(lengths), enforce_eager=True)
        layout = KVLayout(num_layers=cfg.num_layers, block_size=BLOCK, num_kv_heads=cfg.num_kv_heads,
                          head_dim=cfg.head_dim, dtype=dtype)
        for n in lengths:
            prefill = draft_prefill_seconds(runner, n, args.max_num_batched_tokens, cfg.vocab_size, args.repeats)
            num_blocks = layout.num_blocks_for(n)
            src = make_cache(layout, num_blocks + 1)
            ids = list(range(1, num_blocks + 1))
            grpc_s, _ = asyncio.run(bench_grpc(src, torch.zeros_like(src), ids, n, args.repeats,
                                               resolve_max_chunk_bytes(0, layout), n, 0.0))
            num_bytes = num_blocks * layout.bytes_per_block
            print(f"{name:<8} {n:>7} {num_bytes / 2**20:>7.1f} {prefill:>10.3f} {grpc_s:>8.3f} "
                  f"{num_bytes / grpc_s / 1e9:>10.2f} {prefill / grpc_s:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
