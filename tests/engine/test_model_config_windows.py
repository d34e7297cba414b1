"""config.json -> per-layer windows, Gemma 3's local RoPE and query scale, gpt-oss's sinks and YaRN,
as transformers reads the same files (its own configs are the fixtures)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.model_config import ModelConfig, ModelConfigError
from engine.rope import attention_factor, cos_sin_cache, inverse_frequencies

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=300)


def _ours(hf_config) -> ModelConfig:
    raw = hf_config.to_dict()
    raw["architectures"] = [type(hf_config).__name__.replace("TextConfig", "ForCausalLM").replace(
        "Config", "ForCausalLM")]
    return ModelConfig.from_dict(raw)


def test_mistral_windows_every_layer_and_frees_behind_it():
    cfg = _ours(transformers.MistralConfig(num_hidden_layers=3, sliding_window=100, **SMALL))
    assert cfg.layer_windows == (100, 100, 100) and cfg.kv_free_window == 100
    assert cfg.max_model_len == cfg.max_position_embeddings   # a window no longer caps the context
    assert _ours(transformers.MistralConfig(num_hidden_layers=3, sliding_window=None, **SMALL)).layer_windows == ()


def test_qwen2_windows_from_max_window_layers_only_when_enabled():
    on = _ours(transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64,
                                        max_window_layers=2, **SMALL))
    assert on.layer_windows == (0, 0, 64, 64) and on.kv_free_window is None
    off = _ours(transformers.Qwen2Config(num_hidden_layers=4, sliding_window=64, max_window_layers=2, **SMALL))
    assert off.layer_windows == ()


@pytest.mark.parametrize("pattern", [2, 6])
def test_gemma3_interleaves_local_and_global_layers(pattern):
    hf = transformers.Gemma3TextConfig(num_hidden_layers=6, head_dim=16, sliding_window=32,
                                       sliding_window_pattern=pattern, query_pre_attn_scalar=24,
                                       rope_local_base_freq=500.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                                       final_logit_softcapping=30.0, **SMALL)
    cfg = _ours(hf)
    assert cfg.architecture == "gemma3" and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.layer_windows == tuple(0 if t == "full_attention" else 32 for t in hf.layer_types)
    assert cfg.kv_free_window is None and cfg.query_pre_attn_scalar == 24 and cfg.final_logit_softcapping == 30.0
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rope.factor) == (1_000_000.0, "linear", 8.0)
    assert (cfg.local_rope.theta, cfg.local_rope.rope_type) == (500.0, "default")


def test_gemma3_transformers_4_layout_and_multimodal_text_config():
    v4 = dict(architectures=["Gemma3ForCausalLM"], num_hidden_layers=4, head_dim=16, sliding_window=16,
              sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=10000.0,
              rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=256,
              hidden_activation="gelu_pytorch_tanh", **SMALL)
    cfg = ModelConfig.from_dict(v4)
    assert cfg.layer_windows == (16, 0, 16, 0)
    assert (cfg.rope.theta, cfg.rope.factor, cfg.local_rope.theta) == (1e6, 8.0, 10000.0)
    text = {k: v for k, v in v4.items() if k != "architectures"}
    multimodal = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", eos_token_id=[1, 106],
                      text_config=text, vision_config={"hidden_size": 1152})
    mm = ModelConfig.from_dict(multimodal)
    assert mm.architecture == "gemma3" and mm.layer_windows == cfg.layer_windows and mm.eos_token_ids == (1, 106)


def test_gpt_oss_alternates_and_has_sinks():
    cfg = _ours(transformers.GptOssConfig(num_hidden_layers=4, sliding_window=128, head_dim=16, **SMALL))
    assert cfg.layer_windows == (128, 0, 128, 0) and cfg.attention_sinks and cfg.kv_free_window is None
    assert cfg.rope.rope_type == "yarn" and not cfg.rope.truncate


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_and_attention_factor_equal_transformers(truncate):
    hf = transformers.GptOssConfig(num_hidden_layers=2, head_dim=16, **SMALL)
    hf.rope_parameters["truncate"] = truncate
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = _ours(hf)
    assert torch.equal(inverse_frequencies(cfg.rope, 16), inv_freq) and attention_factor(cfg.rope) == factor
    table = cos_sin_cache(cfg.rope, 16, 8, torch.device("cpu"))
    freqs = torch.arange(8, dtype=torch.float32)[:, None] * inv_freq[None, :]
    torch.testing.assert_close(table, torch.cat([freqs.cos() * factor, freqs.sin() * factor], -1), atol=0, rtol=0)


@pytest.mark.parametrize("mutate, message", [
    (lambda raw: raw.update(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    (lambda raw: raw.update(layer_types=["sliding_attention"]), "layer_types"),
    (lambda raw: raw.update(use_bidirectional_attention=True), "bidirectional"),
    (lambda raw: raw.update(hidden_activation="relu"), "hidden_act"),
])
def test_refuses_what_it_cannot_serve(mutate, message):
    raw = dict(architectures=["Gemma3ForCausalLM"], num_hidden_layers=2, head_dim=16, sliding_window=8,
               hidden_activation="gelu_pytorch_tanh", **SMALL)
    mutate(raw)
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict(raw)
