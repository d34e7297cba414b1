"""The clients people point at a server, against real `cbserve up` clusters on a random HF checkpoint
(with a byte-level tokenizer): prompt logprobs equal transformers' log-softmax (fp32, 1e-4) in P/D
and colocated, across chunk boundaries (a 16-token budget) and with a cached prefix; the Responses
API through the `openai` client; lm-evaluation-harness's `local-completions` model (with its remote
tokenizer: /tokenize, /detokenize, /tokenizer_info) scoring a log-likelihood task and a
generate_until task from local files as its `hf` model does on the same weights."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from cbserve.cluster_spec import ClusterSpec
from cbserve.local_cluster import LocalCluster
from engine.tokenizer import build_byte_level_tokenizer
from tests.engine.hf_models import make_hf_model
from tests.test_e2e_openai import _free_blocks

pytestmark = pytest.mark.slow
BUDGET = 16     # max_num_batched_tokens: every prompt here is prefilled in several chunks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval_ckpt")
    hf = make_hf_model("llama_gqa", path)          # vocab 300
    build_byte_level_tokenizer(path, vocab_size=hf.config.vocab_size)
    return path, hf


def _cluster(path: Path, **kw) -> LocalCluster:
    return LocalCluster(ClusterSpec(model=str(path), port=0, threads_per_pod=1, drain_seconds=5, startup_timeout=240,
                                    max_num_batched_tokens=BUDGET, router_args=("--enable-tokenizer-info-endpoint",),
                                    **kw))


@pytest.fixture(scope="module")
def pd_cluster(checkpoint):
    with _cluster(checkpoint[0]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def colocated_cluster(checkpoint):
    with _cluster(checkpoint[0], num_colocated=1) as cluster:
        yield cluster


def _client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120)


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logprobs = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def _echo_scores(client, model: str, ids: list[int]) -> list[float]:
    result = client.completions.create(model=model, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = result.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    assert result.usage.completion_tokens == 0
    return lp.token_logprobs[1:]


@pytest.mark.parametrize("topology", ["pd", "colocated"])
def test_prompt_logprobs_equal_transformers(request, checkpoint, topology):
    path, hf = checkpoint
    cluster = request.getfixturevalue(f"{topology}_cluster")
    client, model = _client(cluster), str(path)
    before = _free_blocks(cluster)
    rng = random.Random(7)
    shared = [rng.randrange(3, 300) for _ in range(40)]
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (37, 5, 2, 50)]
    for ids in prompts:
        torch.testing.assert_close(torch.tensor(_echo_scores(client, model, ids)), _reference(hf, ids),
                                   atol=1e-4, rtol=0)
    # A cached prefix: the first request puts 40 tokens in the prefix cache; the one that asks for
    # scores still gets every token's.
    client.completions.create(model=model, prompt=shared, max_tokens=1, temperature=0)
    longer = shared + [11, 12, 13, 14, 15]
    torch.testing.assert_close(torch.tensor(_echo_scores(client, model, longer)), _reference(hf, longer),
                               atol=1e-4, rtol=0)
    again = client.completions.create(model=model, prompt=longer, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens == len(longer)
    # vLLM's prompt_logprobs: the same scores, with ranks.
    body = client.completions.create(model=model, prompt=prompts[0], max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 2}).model_dump()
    plp = body["choices"][0]["prompt_logprobs"]
    got = [entry[str(token)]["logprob"] for token, entry in zip(prompts[0][1:], plp[1:])]
    torch.testing.assert_close(torch.tensor(got), _reference(hf, prompts[0]), atol=1e-4, rtol=0)
    # Scoring requests (one token sampled and dropped; in P/D the decode pod is cut short) leak nothing.
    deadline = time.monotonic() + 10
    while _free_blocks(cluster) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _free_blocks(cluster) == before


def test_chat_prompt_logprobs_score_the_templated_prompt(pd_cluster, checkpoint):
    path, hf = checkpoint
    client, model = _client(pd_cluster), str(path)
    messages = [{"role": "system", "content": "You score."}, {"role": "user", "content": "Score every token here."}]
    ids = httpx.post(f"{pd_cluster.url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    body = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 0}).model_dump()
    got = [entry[str(token)]["logprob"] for token, entry in zip(ids[1:], body["prompt_logprobs"][1:])]
    assert len(got) == len(ids) - 1
    torch.testing.assert_close(torch.tensor(got), _reference(hf, ids), atol=1e-4, rtol=0)


def test_responses_api_through_the_openai_client(pd_cluster, checkpoint):
    client, model = _client(pd_cluster), str(checkpoint[0])
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model=model, messages=conversation, max_tokens=12, temperature=0)
    response = client.responses.create(model=model, instructions="Be brief.", input="Hello there",
                                       max_output_tokens=12, temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    events = list(client.responses.create(model=model, instructions="Be brief.", input="Hello there",
                                          max_output_tokens=12, temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_text_format_and_forced_tools_follow_their_schemas(pd_cluster, checkpoint):
    """The pods enforce what the router built: a `text.format` schema, and a forced function call
    (no tool parser: vLLM's JSON list, read back as a `function_call` item)."""
    client, model = _client(pd_cluster), str(checkpoint[0])
    # A finite language (bounded whitespace, a boolean): a random model completes it within the limit.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    response = client.responses.create(model=model, input="A boolean as JSON", max_output_tokens=96, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "ok", "schema": schema}})
    assert response.status == "completed", response.output_text
    assert isinstance(json.loads(response.output_text)["ok"], bool)
    tools = [{"type": "function", "name": "check", "parameters": schema}]
    response = client.responses.create(model=model, input="Call check", max_output_tokens=96, temperature=0,
                                       tools=tools, tool_choice="required", parallel_tool_calls=False)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "check" and isinstance(json.loads(call.arguments)["ok"], bool), response.output


# ----------------------------------------------------------------------------------- lm-evaluation-harness
def _write_tasks(root: Path) -> Path:
    """Two tasks over local JSONL files (no hub): multiple-choice log-likelihood and generate_until."""
    rng = random.Random(0)
    words = ["red", "blue", "cat", "dog", "sun", "moon", "tree", "rock"]
    with open(root / "mc.jsonl", "w") as f:
        for i in range(6):
            question = " ".join(rng.choice(words) for _ in range(4 + 2 * i))   # up to 40 tokens: several chunks
            f.write(json.dumps({"question": f"Q: {question}?\nA:", "choices": [" yes", " no", " it is unclear"],
                                "answer": i % 3}) + "\n")
    with open(root / "gen.jsonl", "w") as f:
        for i in range(3):
            phrase = " ".join(rng.choice(words) for _ in range(3 + i))
            f.write(json.dumps({"question": f"Say: {phrase}", "answer": phrase}) + "\n")
    tasks = root / "tasks"
    tasks.mkdir()
    common = "test_split: test\ndataset_path: json\n"
    (tasks / "mc.yaml").write_text(
        f"task: cbserve_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (tasks / "gen.yaml").write_text(
        f"task: cbserve_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \"rock\"]\n  max_gen_toks: 10\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return tasks


def _harness(model: str, model_args: str, tasks: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["cbserve_mc", "cbserve_gen"],
                                   task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
                                   batch_size=2, random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def test_lm_eval_harness_scores_through_pd_equal_its_transformers_scores(pd_cluster, checkpoint, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = checkpoint[0]
    tasks = _write_tasks(tmp_path)
    served = _harness("local-completions", f"model={path},base_url={pd_cluster.base_url}/completions,"
                      "tokenizer_backend=remote,tokenized_requests=True,num_concurrent=1,max_retries=1", tasks)
    # The remote tokenizer encodes without special tokens; transformers' tokenizer adds BOS unless told
    # not to: the same prompts on both sides need add_bos_token=False for `hf`.
    reference = _harness("hf", f"pretrained={path},dtype=float32,device=cpu,add_bos_token=False", tasks)
    for task, metrics in reference["results"].items():
        for name, value in metrics.items():
            if name.split(",")[0] in ("acc", "acc_norm", "exact_match"):
                assert served["results"][task][name] == value, (task, name)
    for theirs, ours in zip(reference["samples"]["cbserve_mc"], served["samples"]["cbserve_mc"]):
        assert theirs["doc_id"] == ours["doc_id"]
        for (lp_ref, greedy_ref), (lp, greedy) in zip(theirs["filtered_resps"], ours["filtered_resps"]):
            assert lp == pytest.approx(lp_ref, abs=1e-3) and greedy == greedy_ref
    texts = [s["filtered_resps"] for s in served["samples"]["cbserve_gen"]]
    assert texts == [s["filtered_resps"] for s in reference["samples"]["cbserve_gen"]]
    assert any(t[0] for t in texts), "the generations are not all empty"
