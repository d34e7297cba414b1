"""Planner test fixtures: a synthetic profile of the tiny preset (no device measurement needed)."""

from __future__ import annotations

import pytest

from cbserve.planner.cost_model import FEATURES, StepCostModel
from cbserve.planner.profile import ServingProfile, build_profile

# ~4 ms a step plus 0.1 ms a token: about tiny's CPU cost on one core.
COEFFICIENTS = {"intercept": 0.004, "tokens": 0.1, "decode_context": 0.02, "prefill_attention": 0.05}


def make_profile(serving: ServingProfile | None = ServingProfile(contention=1.2, prefill_contention=1.1,
                                                                 step_gap_s=0.001, http_in_s=0.002, rpc_s=0.001,
                                                                 token_out_s=0.002, kv_message_s=0.001,
                                                                 kv_bytes_per_s=500e6),
                 device: str = "cpu", held_out: float = 0.03):
    model = StepCostModel(tuple(COEFFICIENTS.get(name, 0.0) for name in FEATURES))
    data = {"created": "2026-01-01T00:00:00Z", "cbserve_commit": None,
            "device": {"type": device, "name": "test", "cpu_count": 2, "torch": "test", "threads": 1},
            "model": {"name": "tiny", "fingerprint": "test", "dtype": "float32", "quantization": None,
                      "kv_cache_dtype": "float32", "vocab_size": 262},
            "engine": {"max_num_batched_tokens": 512, "max_num_seqs": 64, "max_model_len": 2048, "block_size": 16,
                       "num_blocks": 2048, "kv_bytes_per_token": 4096, "tensor_parallel_size": 1, "flags": {}},
            "timer": "thread_time", "grid": [], "held_out_points": [],
            "fit": {"mape": held_out, "max_error": 0.1, "points": 40, "by_kind": {}},
            "held_out": {"mape": held_out, "max_error": 0.1, "points": 12, "by_kind": {}},
            "seconds": {"grid": 1.0}}
    return build_profile(data, model, serving)


@pytest.fixture
def profile():
    return make_profile()


@pytest.fixture
def profile_file(tmp_path, profile):
    path = tmp_path / "profile.json"
    profile.save(path)
    return path
