"""The LoRA flags of `cbserve generate | prefill | decode | up` (vLLM's names) -> `LoRAConfig`."""

from __future__ import annotations

import argparse

from cbserve.arg_types import positive_int
from engine.lora.config import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoRAConfig, parse_lora_module


def _lora_module(value: str):
    try:
        return parse_lora_module(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters: requests select one by `model`")
    g.add_argument("--lora-modules", nargs="+", action="extend", type=_lora_module, default=[],
                   metavar="NAME=PATH",
                   help="adapters to load at start, as name=path or JSON {\"name\", \"path\", \"base_model_name\"} "
                        "(PEFT directories: adapter_config.json + adapter_model.safetensors)")
    g.add_argument("--max-loras", type=positive_int, default=DEFAULT_MAX_LORAS,
                   help=f"adapters in one batch: device slots, allocated at start (default {DEFAULT_MAX_LORAS})")
    g.add_argument("--max-cpu-loras", type=positive_int, default=None,
                   help="adapters kept in host memory (LRU); others are read again when needed "
                        "(default: --max-loras)")
    g.add_argument("--max-lora-rank", type=positive_int, default=DEFAULT_MAX_LORA_RANK,
                   help=f"largest adapter rank accepted (default {DEFAULT_MAX_LORA_RANK}); slots store it "
                        "rounded up to a power of two >= 16")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="accept LoadLoRAAdapter / UnloadLoRAAdapter (the router's /v1/load_lora_adapter), "
                        "reading adapters only under --lora-root (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    g.add_argument("--lora-root", default=None, metavar="DIR",
                   help="the directory runtime-loaded adapters must lie under (symlinks resolved)")


def lora_config_from_args(args: argparse.Namespace) -> LoRAConfig | None:
    """The engine's LoRA settings, None without --enable-lora; ValueError on a bad combination."""
    if not args.enable_lora:
        given = [flag for flag, value in (("--lora-modules", args.lora_modules),
                                           ("--allow-runtime-lora-updating", args.allow_runtime_lora_updating),
                                           ("--lora-root", args.lora_root)) if value]
        if given:
            raise ValueError(f"{', '.join(given)} needs --enable-lora")
        return None
    if args.allow_runtime_lora_updating and not args.lora_root:
        raise ValueError("--allow-runtime-lora-updating needs --lora-root DIR (runtime adapters load only "
                         "from under it)")
    return LoRAConfig(max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.max_lora_rank,
                      lora_modules=tuple(args.lora_modules),
                      allow_runtime_lora_updating=args.allow_runtime_lora_updating, lora_root=args.lora_root)


def lora_cluster_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """`cbserve up`: (the LoRA flags of every pod, the router's), from the parsed LoRA flags
    (checked first: a bad combination is a ValueError before anything starts)."""
    config = lora_config_from_args(args)
    if config is None:
        return [], []
    pods = ["--enable-lora", "--max-loras", str(config.max_loras), "--max-lora-rank", str(config.max_lora_rank)]
    if config.max_cpu_loras is not None:
        pods += ["--max-cpu-loras", str(config.max_cpu_loras)]
    if config.lora_modules:
        pods += ["--lora-modules", *(f"{m.name}={m.path}" for m in config.lora_modules)]
    router = ["--enable-lora"]
    if config.allow_runtime_lora_updating:
        pods += ["--allow-runtime-lora-updating", "--lora-root", config.lora_root]
        router.append("--allow-runtime-lora-updating")
    return pods, router
