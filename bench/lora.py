"""Multi-LoRA cost, side by side in one run: the base model, one rank-16 adapter, and 8 distinct
adapters per batch (resident in their slots, or copied in from host memory at every batch);
and the device memory of 100 registered adapters against the `--max-loras` slots.

One engine serves every case (same weights, same slots), so the cases differ only in the
adapters their requests name. Each round runs every case once, in turn; the figures are the
medians over rounds, and each ratio compares figures of the same run:

* throughput: output tokens / wall time of a batch (prefill of every prompt included);
* TTFT: the mean over the batch's requests of arrival to first token (all arrive at once, so it
  includes queueing behind the other prompts' prefill chunks);
* TPOT: the mean time of the batch's decode-only steps (each gives every running request a token).

"from host" cycles two sets of 8 adapters through the 8 slots, so every batch first copies its 8
adapters into slots (the host cache holds all 16: no disk read). Adapters are random PEFT-format
files written here (every projection targeted: q/k/v/o and gate/up/down), not trained ones:
the cost does not depend on the values.

    python bench/lora.py --model small --batch 8 --prompt-len 64 --max-tokens 32 --rounds 3      # docs/benchmarks.md
    python bench/lora.py --model small --batch 32 --prompt-len 64 --max-tokens 32 --rounds 3 --registered 1
    python bench/lora.py --shape 8b --device cuda --dtype bfloat16 --batch 64 --max-tokens 128   # GPU: unmeasured
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

if __package__ in (None, ""):   # `python bench/lora.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.lora.config import LoRAConfig
from engine.model_config import ModelConfig
from engine.presets import resolve_model_dir
from engine.sampling.params import SamplingParams

TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(cfg: ModelConfig, path: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of every projection of `cfg`'s dense layers."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (cfg.q_size, cfg.hidden_size), "k_proj": (cfg.kv_size, cfg.hidden_size),
              "v_proj": (cfg.kv_size, cfg.hidden_size), "o_proj": (cfg.hidden_size, cfg.q_size),
              "gate_proj": (cfg.intermediate_size, cfg.hidden_size), "up_proj": (cfg.intermediate_size, cfg.hidden_size),
              "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    tensors = {}
    for layer in range(cfg.num_layers):
        for block, names in TARGETS.items():
            for name in names:
                out_features, in_features = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn((rank, in_features), generator=gen) / math.sqrt(in_features)
                tensors[f"{key}.lora_B.weight"] = torch.randn((out_features, rank), generator=gen) / math.sqrt(rank)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [n for names in TARGETS.values() for n in names]}))
    return path


def run_batch(engine: Engine, prompts: list[list[int]], loras: list[str | None], max_tokens: int,
              device: torch.device) -> tuple[float, float, float, int]:
    """(output tokens per second, mean TTFT seconds, mean decode-step seconds, slot copies) of one batch."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    loads = engine.lora.slots.num_loads
    first_step = engine.num_steps
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, lora=loras)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    assert all(len(o.output_token_ids) == max_tokens for o in outputs)
    steps = list(engine.step_samples)[-(engine.num_steps - first_step):]
    decode = [s.seconds for s in steps if s.num_prefill_tokens == 0]
    ttft = statistics.fmean(o.first_token_time - o.arrival_time for o in outputs)
    return (len(prompts) * max_tokens / elapsed, ttft, statistics.fmean(decode),
            engine.lora.slots.num_loads - loads)


def memory_of_registered(engine: Engine, root: Path, cfg: ModelConfig, count: int, rank: int,
                         device: torch.device) -> dict:
    """Device and host memory before and after registering `count` more adapters."""
    def device_bytes() -> int:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return torch.cuda.memory_allocated(device)
        return sum(t.numel() * t.element_size() for t in (*engine.model.parameters(), *engine.model.buffers()))

    registry = engine.lora.registry
    before = device_bytes()
    cached_before = len(registry.cached_identities())
    for i in range(count):
        registry.register(f"registered-{i}", str(write_adapter(cfg, root / f"registered-{i}", rank, 1000 + i)))
    adapter_bytes = engine.lora.request("registered-0").adapter.num_bytes
    return {"registered": len(registry.registered()), "device_bytes_before": before,
            "device_bytes_after": device_bytes(), "slot_bytes": engine.lora.model.device_bytes,
            "host_cached_adapters": len(registry.cached_identities()), "host_cached_before": cached_before,
            "host_bytes_per_adapter": adapter_bytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="preset or HF directory (dense Llama-family)")
    p.add_argument("--shape", default=None, help="a real model's shape with random weights (bench/shapes.py: 1b, 8b)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--batch", type=int, default=16, help="requests per batch (all admitted at once)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--registered", type=int, default=100, help="adapters registered for the memory figure")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()
    device = torch.device(args.device)
    if args.shape:
        from bench.shapes import model_dir as shape_dir
        model_dir = shape_dir(args.shape, args.device)
    else:
        model_dir = resolve_model_dir(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    root = Path(tempfile.mkdtemp(prefix="cbserve-lora-bench-"))
    adapters = [str(write_adapter(cfg, root / f"adapter-{i}", args.rank, i)) for i in range(16)]
    engine = Engine(EngineConfig(
        model=str(model_dir), device=args.device, dtype=args.dtype,
        cache=CacheConfig(enable_prefix_caching=False, num_blocks=args.batch * (-(-(args.prompt_len + args.max_tokens) // 16)) + 8),
        scheduler=SchedulerConfig(max_num_batched_tokens=max(512, args.prompt_len * 4), max_num_seqs=args.batch),
        lora=LoRAConfig(max_loras=8, max_cpu_loras=32, max_lora_rank=args.rank)))
    for i, path in enumerate(adapters):
        engine.lora.registry.register(f"adapter-{i}", path)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    set_a = [f"adapter-{i % 8}" for i in range(args.batch)]
    set_b = [f"adapter-{8 + i % 8}" for i in range(args.batch)]
    cases = {"base": [None] * args.batch, "1 adapter (rank %d)" % args.rank: ["adapter-0"] * args.batch,
             "8 adapters, resident": set_a, "8 adapters, from host": None}
    engine.generate(prompts[:2], SamplingParams(max_tokens=2), lora=[None, "adapter-0"])   # warm-up
    figures: dict[str, list[tuple[float, float, float, int]]] = {name: [] for name in cases}
    swap = False
    for _ in range(args.rounds):
        for name, loras in cases.items():
            if loras is None:               # alternate the sets: every batch copies 8 adapters in
                swap = not swap
                loras = set_b if swap else set_a
            elif name == "8 adapters, resident":
                run_batch(engine, prompts[:8], set_a[:8], 2, device)   # make set A resident first
            figures[name].append(run_batch(engine, prompts, loras, args.max_tokens, device))
            tps, ttft, tpot, copies = figures[name][-1]    # as it goes: a run cut short still tells
            print(f"round {len(figures[name])} {name}: {tps:.1f} tok/s, TTFT {ttft * 1e3:.0f} ms, "
                  f"TPOT {tpot * 1e3:.1f} ms, {copies} slot copies", file=sys.stderr, flush=True)
    base_tps = statistics.median(f[0] for f in figures["base"])
    base_ttft = statistics.median(f[1] for f in figures["base"])
    base_tpot = statistics.median(f[2] for f in figures["base"])
    print(f"model {args.shape or args.model} on {args.device}, batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.max_tokens} output tokens, rank {args.rank}, {args.rounds} rounds (medians)")
    print(f"{'case':<24} {'tok/s':>9} {'vs base':>8} {'TTFT ms':>8} {'vs base':>8} {'TPOT ms':>8} {'vs base':>8} "
          f"{'slot copies':>11}")
    rows = {}
    for name, runs in figures.items():
        tps, ttft, tpot, copies = (statistics.median(r[i] for r in runs) for i in range(4))
        rows[name] = {"tokens_per_second": tps, "ttft_seconds": ttft, "tpot_seconds": tpot,
                      "throughput_vs_base": tps / base_tps, "ttft_vs_base": ttft / base_ttft,
                      "tpot_vs_base": tpot / base_tpot, "slot_copies_per_batch": copies}
        print(f"{name:<24} {tps:9.1f} {tps / base_tps:8.3f} {ttft * 1e3:8.1f} {ttft / base_ttft:8.3f} "
              f"{tpot * 1e3:8.2f} {tpot / base_tpot:8.3f} {copies:11.0f}")
    memory = memory_of_registered(engine, root, cfg, args.registered, args.rank, device)
    print(f"{memory['registered']} adapters registered: device memory {memory['device_bytes_before'] / 2**20:.1f} MiB "
          f"before the last {args.registered}, {memory['device_bytes_after'] / 2**20:.1f} MiB after; the 8 slots "
          f"take {memory['slot_bytes'] / 2**20:.1f} MiB of it; host memory holds {memory['host_cached_adapters']} "
          f"adapters (--max-cpu-loras 32) of {memory['host_bytes_per_adapter'] / 2**20:.2f} MiB each")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "cases": rows, "memory": memory}, indent=2))


if __name__ == "__main__":
    main()
