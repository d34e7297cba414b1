"""Which model family serves a checkpoint: HF `architectures` (or `model_type`) -> family -> class.

A family name is the HF `model_type` of its checkpoints (`ModelConfig.architecture`); several
families may share one implementation (Llama, Mistral and Qwen2 are all `llama.py`). Torch-free
at import: the config parser reads the tables, and `model_class` imports a family's module only
when a model of it is built.
"""

from __future__ import annotations

import importlib

# HF `architectures` entry -> family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",   # the text model only (engine/models/gemma3.py)
    "GptOssForCausalLM": "gpt_oss",
}
# family -> (module, class) implementing it
FAMILIES = {
    "llama": ("engine.models.llama", "LlamaForCausalLM"),
    "mistral": ("engine.models.llama", "LlamaForCausalLM"),
    "qwen2": ("engine.models.llama", "LlamaForCausalLM"),
    "qwen3": ("engine.models.qwen3", "Qwen3ForCausalLM"),
    "mixtral": ("engine.models.mixtral", "MixtralForCausalLM"),
    "qwen2_moe": ("engine.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("engine.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3": ("engine.models.gemma3", "Gemma3ForCausalLM"),
    "gpt_oss": ("engine.models.gpt_oss", "GptOssForCausalLM"),
}


def family_of(architectures: list[str], model_type: str | None) -> str | None:
    """The family of a config.json: its first supported `architectures` entry, else its
    `model_type` when that names a family; None when cbserve serves neither."""
    for arch in architectures:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if not architectures and model_type in FAMILIES:
        return model_type
    return None


def model_class(family: str) -> type:
    """The `CausalLM` subclass of `family` (a key of `FAMILIES`)."""
    module, name = FAMILIES[family]
    return getattr(importlib.import_module(module), name)
