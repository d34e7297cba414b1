"""Sliding-window families at TP=2 on CPU (Gloo): the same greedy tokens as transformers and as
TP=1, logprobs within the TP tolerance (Mistral's window, Gemma 3's local/global layers and
norms, gpt-oss's sinks, split by query head, and its experts)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.hf_window_models import WINDOW_CONFIGS, make_window_model
from tests.engine.test_tensor_parallel import LOGPROB_TOLERANCE, _generate, _prompts


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("CBSERVE_NUM_THREADS", "1")   # the rank subprocesses read it


@pytest.mark.parametrize("name", sorted(WINDOW_CONFIGS))
def test_tp2_equals_tp1_and_transformers(tmp_path, name):
    hf = make_window_model(name, tmp_path / name)
    prompts = _prompts(hf.config.vocab_size)      # 5, 90 and 17 tokens: longer than every window
    one, two = _generate(tmp_path / name, 1, prompts), _generate(tmp_path / name, 2, prompts)
    for prompt, (tokens1, lps1), (tokens2, lps2) in zip(prompts, one, two):
        with torch.no_grad():   # both stop at eos (id 2) within the 8 tokens
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
        if 2 in want:
            want = want[:want.index(2) + 1]
        assert tokens1 == want and tokens2 == want
        for lp1, lp2 in zip(lps1, lps2):
            assert abs(lp1.logprob - lp2.logprob) <= LOGPROB_TOLERANCE


def test_tp2_reads_mxfp4_experts_in_shards(tmp_path):
    # The MXFP4 experts are dequantized in memory and each rank takes its intermediate slice.
    from tests.engine.hf_window_models import write_mxfp4_checkpoint

    make_window_model("gpt_oss", tmp_path / "float")
    write_mxfp4_checkpoint(tmp_path / "float", tmp_path / "mxfp4")
    prompts = _prompts(300)
    one, two = _generate(tmp_path / "mxfp4", 1, prompts), _generate(tmp_path / "mxfp4", 2, prompts)
    for (tokens1, lps1), (tokens2, lps2) in zip(one, two):
        assert tokens1 == tokens2
        for lp1, lp2 in zip(lps1, lps2):
            assert abs(lp1.logprob - lp2.logprob) <= LOGPROB_TOLERANCE
