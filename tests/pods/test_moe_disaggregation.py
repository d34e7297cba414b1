"""1 prefill + 1 decode pod as real processes serving a mixture of experts (Qwen2-MoE: a shared
expert, a dense layer among MoE ones, top-3 of 5): disaggregated tokens equal the colocated
engine's, greedy and seeded, over both transports, with chunked prefill and a shared prefix.

The test is test_disaggregation.py's own, collected here a second time: pytest runs it with
this module's `pods` and `reference` fixtures, the MoE model's."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from tests.engine.hf_models import make_hf_model
from tests.pods.podproc import pod_pair
from tests.pods.test_disaggregation import test_disaggregated_equals_colocated  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-moe")
    make_hf_model("qwen2_moe_packed", path)        # vocab 300: the shared test's prompts fit
    return path


@pytest.fixture(scope="module")
def pods(checkpoint):
    with pod_pair("--model", str(checkpoint), "--kv-transport", "nccl") as pair:
        yield pair


@pytest.fixture(scope="module")
def reference(checkpoint):
    return Engine(EngineConfig(model=str(checkpoint), cache=CacheConfig(num_blocks=512),
                               scheduler=SchedulerConfig(max_num_batched_tokens=64)))
