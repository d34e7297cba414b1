"""The `cbserve` command. Each subcommand parses flags and hands over to its component.

`generate` prints only the generated text on stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset name (tiny, small) or a local HF directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-mb", type=int, default=256)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--policy", choices=["fcfs", "priority"], default="fcfs")


def engine_config_from_args(args: argparse.Namespace, role: str):
    from engine.config import CacheConfig, SchedulerConfig
    from engine.engine import EngineConfig

    return EngineConfig(
        model=args.model, role=role, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          kv_cache_memory_bytes=args.kv_cache_memory_mb << 20,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, policy=args.policy),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.engine import Engine, EngineRequestError
    from engine.sampling_params import SamplingParams, SamplingParamsError

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens)
    except SamplingParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = Engine(engine_config_from_args(args, "colocated"))
    try:
        (out,) = engine.generate([args.prompt], params)
    except EngineRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(out.text)
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation for one prompt")
    _add_engine_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
