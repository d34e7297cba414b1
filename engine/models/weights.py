"""Checkpoint tensor names -> our parameters: which parameter, which fused part, which expert.

Our layout fuses what the checkpoint keeps apart: `q_proj`/`k_proj`/`v_proj` -> `qkv_proj`
(parts 0/1/2) and `gate_proj`/`up_proj` -> `gate_up_proj` (parts 0/1); a mixture of experts holds
all its experts in two 3-D parameters, `experts.gate_up_proj [E, 2I, H]` and `experts.down_proj
[E, H, I]` (transformers 5's runtime layout), so a checkpoint saved that way ("packed") loads
tensor for tensor, and one with per-expert tensors (`experts.{e}.gate_proj/up_proj/down_proj`,
what `save_pretrained` writes by default) fills one expert's slice per tensor. A family's other
spellings (Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`) are renamed first
(`CausalLM.hf_renames`).

The suffix is kept (`weight`, `bias`, and an FP8 checkpoint's `weight_scale` / `input_scale`).
Pure string work: the loader and the FP8 checkpoint loader share it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.model_config import ModelConfig

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# checkpoint module -> (our fused module, part)
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: `param[expert]` (a per-expert tensor) or all of `param`,
    and within that the rows of fused `part` (None: the whole of it)."""

    param: str
    part: int | None = None
    expert: int | None = None


def map_name(hf_name: str, cfg: ModelConfig, renames: tuple[tuple[str, str], ...] = (),
             ignored: tuple[str, ...] = ()) -> WeightTarget | None:
    """Checkpoint tensor name -> its `WeightTarget`; None for tensors that are not loaded (rotary
    caches, the lm_head of a tied model, names matching one of the `ignored` regexes)."""
    if hf_name.endswith(IGNORED_SUFFIXES):
        return None
    name = hf_name.removeprefix("model.")
    if any(re.match(pattern, name) for pattern in ignored):
        return None
    for pattern, repl in renames:
        name = re.sub(pattern, repl, name)
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None
    expert = _EXPERT.match(name)
    if expert is not None:
        proj = expert["proj"]
        param = f"{expert['prefix']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        return WeightTarget(param, None if proj == "down_proj" else FUSED[proj][1], int(expert["expert"]))
    module, _, suffix = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    if leaf in FUSED and parent:
        fused, part = FUSED[leaf]
        return WeightTarget(f"{parent}.{fused}.{suffix}", part)
    return WeightTarget(name)


def is_expert_param(name: str) -> bool:
    return name.endswith(EXPERT_PARAMS)


def num_parts(name: str) -> int:
    """How many checkpoint tensors a parameter of ours fuses along its rows (1: none)."""
    module = name if is_expert_param(name) else name.rpartition(".")[0]
    return 3 if module.endswith("qkv_proj") else 2 if module.endswith("gate_up_proj") else 1


def part_sizes(cfg: ModelConfig, name: str, rows: int) -> list[int]:
    """Row counts of the fused parts of parameter `name`, whose (per-expert) rows number `rows`;
    `cfg` is the model's own (this rank's share under tensor parallelism)."""
    parts = num_parts(name)
    if parts == 3:
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    return [rows // parts] * parts


def expected_pieces(name: str, shape: tuple[int, ...]) -> frozenset[tuple[int | None, int | None]]:
    """The `(expert, part)` pieces a checkpoint must supply for parameter `name` of `shape`."""
    experts = range(shape[0]) if is_expert_param(name) else (None,)
    parts = num_parts(name)
    return frozenset((e, p) for e in experts for p in (range(parts) if parts > 1 else (None,)))


def covered_pieces(target: WeightTarget, pieces: frozenset) -> frozenset:
    """The pieces of `pieces` that one tensor mapped to `target` fills (a packed tensor: all)."""
    return frozenset((e, p) for e, p in pieces if target.expert in (None, e) and target.part in (None, p))
