"""Random PEFT LoRA adapters for equivalence tests, made and saved with `peft` itself.

`init_lora_weights=False` gives B non-zero values; both matrices are then re-drawn at
O(1/sqrt(fan_in)) so each adapter changes the logits visibly (greedy tokens differ from the base
model's) without swamping them. `peft_model(base_dir, adapter_dirs)` loads the saved adapters
back onto a fresh copy of the base model: the reference the engine is compared with.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base_model, out_dir: Path, r: int = 8, alpha: float = 16, targets=ALL_TARGETS,
                 use_rslora: bool = False, seed: int = 0, scale: float = 1.0) -> Path:
    """Save a random adapter of `base_model` (an HF model, left unchanged) to `out_dir`."""
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(base_model), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / math.sqrt(p.shape[1]))
    model.save_pretrained(out_dir)
    return out_dir


def peft_model(base_dir: Path, adapter_dir: Path):
    """The base checkpoint with the saved adapter applied, fp32, eval mode (the reference)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@torch.no_grad()
def greedy(model, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's logits of `model` (HF or PEFT) for one prompt."""
    ids = torch.tensor([prompt])
    tokens, logits = [], []
    for _ in range(num_tokens):
        step = model(input_ids=ids).logits[0, -1]
        logits.append(step)
        token = int(step.argmax())
        tokens.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logits
