"""Multi-LoRA under tensor parallelism (Gloo on CPU): TP=2 gives the same greedy tokens and
logprobs as TP=1 for a batch mixing adapters and the base model. The adapters' shards follow the
base layers (B's rows for q/k/v and gate/up, A's columns for o and down), including a KV head
replicated on both ranks, and a row-parallel partial added before the existing all-reduce.

The TP=2 engine spawns one real rank subprocess; the test process is rank 0.
"""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.lora.config import LoRAConfig, LoRAModule
from engine.sampling.params import SamplingParams
from tests.engine.hf_models import make_hf_model
from tests.engine.lora_adapters import make_adapter
from tests.engine.test_tensor_parallel import LOGPROB_TOLERANCE, TP_CONFIGS, _prompts

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("CBSERVE_NUM_THREADS", "1")


@pytest.mark.parametrize("name", ["qwen2_tied_kv1", "llama_bias_gqa3"])
def test_tp2_equals_tp1_with_adapters(tmp_path, name):
    hf = make_hf_model(name, tmp_path / "base", configs=TP_CONFIGS)
    adapters = (LoRAModule("all", str(make_adapter(hf, tmp_path / "all", r=8, seed=1))),
                LoRAModule("qv", str(make_adapter(hf, tmp_path / "qv", r=4, targets=("q_proj", "v_proj"),
                                                  use_rslora=True, seed=2))))
    prompts = _prompts(hf.config.vocab_size)
    names = ["all", None, "qv"]

    def run(tp: int):
        engine = Engine(EngineConfig(model=str(tmp_path / "base"), tensor_parallel_size=tp,
                                     cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(max_num_batched_tokens=64),
                                     lora=LoRAConfig(max_loras=2, max_lora_rank=8, lora_modules=adapters)))
        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
        try:
            ids = [engine.add_request(p, params, lora=a).request_id for p, a in zip(prompts, names)]
            base = [engine.add_request(p, params).request_id for p in prompts]
            tokens = {i: [] for i in ids + base}
            logprobs = {i: [] for i in ids + base}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens[out.request_id] += out.new_token_ids
                    logprobs[out.request_id] += out.new_logprobs
            return [(tokens[i], logprobs[i]) for i in ids], [tokens[i] for i in base]
        finally:
            engine.close()

    (one, base), (two, _) = run(1), run(2)
    assert one[0][0] != base[0] and one[2][0] != base[2], "the adapters should change the greedy tokens"
    for (tokens1, lps1), (tokens2, lps2) in zip(one, two):
        assert tokens2 == tokens1
        for lp1, lp2 in zip(lps1, lps2):
            assert abs(lp1.logprob - lp2.logprob) <= LOGPROB_TOLERANCE
