"""Speculative decoding on real pods: a decode pod that verifies drafts (n-gram, a draft model
that prefills itself from the prompt it receives, or an EAGLE head, which has no hidden states for
a prompt prefilled elsewhere) gives the tokens of the colocated engine without
speculation, disaggregated (KV pulled from a prefill pod, which takes the flag and ignores it) and
prefilled locally; its /metrics count the drafts with vLLM's names.

A prefill pod given the same draft model prefills the draft too and ships its KV with the
target's, over gRPC and over a Gloo pair: the tokens are the same, the decode pod says the draft's
KV came, and a Generate cancelled mid-stream leaves no block held on either pod. From a prefill
pod without the draft (the first pod) the draft decode pod prefills its draft itself."""

from __future__ import annotations

import asyncio
import random
import urllib.request

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from tests.pods.podproc import Pod, disaggregated, run, sampling
from wire import cbserve_pb2 as pb

pytestmark = pytest.mark.slow

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
DRAFT = '{"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}'
NCCL = ("--kv-transport", "nccl")   # Gloo on CPU; the pods serve gRPC pulls too


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    from engine.presets import resolve_model_dir
    from tests.engine.hf_models import make_eagle_head

    head = make_eagle_head(resolve_model_dir("tiny"), tmp_path_factory.mktemp("eagle"), seed=1)
    eagle = f'{{"method": "eagle", "model": "{head}", "num_speculative_tokens": 3}}'
    prefill = Pod("prefill", "--speculative-config", NGRAM)
    decoders = {"ngram": Pod("decode", "--speculative-config", NGRAM),
                "draft_model": Pod("decode", "--speculative-config", DRAFT, *NCCL),
                "eagle": Pod("decode", "--speculative-config", eagle)}
    ships = Pod("prefill", "--speculative-config", DRAFT, *NCCL)   # a prefill pod with the draft model
    try:
        for pod in (prefill, *decoders.values(), ships):
            pod.wait_ready()
        yield prefill, decoders, ships
    finally:
        for pod in (prefill, *decoders.values(), ships):
            pod.stop()


@pytest.fixture(scope="module")
def reference():
    return Engine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=512),
                               scheduler=SchedulerConfig(max_num_batched_tokens=64)))


def _prompts() -> list[list[int]]:
    rng = random.Random(25)
    return [[1] + [rng.randrange(4, 260) for _ in range(n)] for n in (100, 30, 7)]


PARAMS = {
    "greedy": dict(temperature=0.0, max_tokens=24, ignore_eos=True),
    "seeded": dict(temperature=0.8, top_p=0.9, seed=77, max_tokens=24, ignore_eos=True),
}


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_disaggregated_with_speculation_equals_colocated_without(pods, reference, method, mode):
    prefill, decoders, _ = pods
    prompts = _prompts()
    expected = [o.output_token_ids for o in reference.generate(prompts, SamplingParams(**PARAMS[mode]))]

    async def all_at_once():
        return await asyncio.gather(*(
            disaggregated(prefill, decoders[method], f"{method}-{mode}-{i}", p, sampling(**PARAMS[mode]))
            for i, p in enumerate(prompts)))

    results = run(all_at_once())
    assert [tokens for tokens, _ in results] == expected
    for _, messages in results:
        assert not messages[0].local_prefill
        assert not messages[0].draft_kv_shipped          # this prefill pod has no draft model
        assert messages[-1].finished and messages[-1].finish_reason == "length"


@pytest.mark.parametrize(("mode", "transport"), [("greedy", "grpc"), ("seeded", "nccl")])
def test_the_drafts_kv_shipped_by_the_prefill_pod_gives_the_colocated_tokens(pods, reference, mode, transport):
    _, decoders, ships = pods
    decode = decoders["draft_model"]
    prompts = _prompts()
    expected = [o.output_token_ids for o in reference.generate(prompts, SamplingParams(**PARAMS[mode]))]

    async def all_at_once():
        return await asyncio.gather(*(
            disaggregated(ships, decode, f"ships-{mode}-{i}", p, sampling(**PARAMS[mode]), transport=transport)
            for i, p in enumerate(prompts)))

    results = run(all_at_once())
    assert [tokens for tokens, _ in results] == expected
    for _, messages in results:
        assert not messages[0].local_prefill and messages[0].draft_kv_shipped
    for pod in (ships, decode):
        pod.wait_free_blocks(pod.load().num_total_blocks, timeout=30)


def test_a_generate_cancelled_after_the_drafts_kv_landed_frees_both_pods_blocks(pods):
    _, decoders, ships = pods
    decode = decoders["draft_model"]

    async def cancelled():
        from tests.pods.podproc import dispatch, pod_channel

        params = sampling(**{**PARAMS["greedy"], "max_tokens": 400})
        async with pod_channel(ships.address) as pc, pod_channel(decode.address) as dc:
            pre, gen = dispatch(pc, dc, ships.address, "ships-cancel", _prompts()[0], params)
            first = await gen.read()
            gen.cancel()
            await pre
        return first

    assert run(cancelled()).draft_kv_shipped
    for pod in (ships, decode):
        pod.wait_free_blocks(pod.load().num_total_blocks, timeout=30)


def test_local_prefill_with_a_draft_model_equals_colocated(pods, reference):
    _, decoders, _ = pods
    prompt = _prompts()[0]
    expected = reference.generate([prompt], SamplingParams(**PARAMS["greedy"]))[0].output_token_ids

    async def local():
        from tests.pods.podproc import pod_channel
        from wire import cbserve_pb2_grpc as pb_grpc

        async with pod_channel(decoders["draft_model"].address) as ch:
            stream = pb_grpc.DecodeServiceStub(ch).Generate(pb.GenerateRequest(
                request_id="draft-local", prompt_token_ids=prompt, sampling=sampling(**PARAMS["greedy"])), timeout=60)
            return [m async for m in stream]

    messages = run(local())
    assert messages[0].local_prefill
    assert [t for m in messages for t in m.token_ids] == expected


def test_decode_pod_metrics_count_drafts(pods):
    _, decoders, _ = pods
    pod = decoders["draft_model"]          # a draft equal to the target: greedy drafts are accepted
    run(disaggregated(pods[0], pod, "metrics-0", _prompts()[1], sampling(**PARAMS["greedy"])))
    deadline_text = ""
    for _ in range(50):                    # the server process gets the counts with the next statistics
        text = urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics_port}/metrics", timeout=10).read().decode()
        values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                  if line.startswith("cbserve_spec_decode_") and " " in line}
        deadline_text = text
        if values.get('cbserve_spec_decode_num_accepted_tokens_total{role="decode"}', 0) > 0:
            break
        run(asyncio.sleep(0.2))
    else:
        raise AssertionError(f"no accepted drafts counted:\n{deadline_text[-2000:]}")
    assert values['cbserve_spec_decode_num_draft_tokens_total{role="decode"}'] >= \
        values['cbserve_spec_decode_num_accepted_tokens_total{role="decode"}']
    assert values['cbserve_spec_decode_num_drafts_total{role="decode"}'] > 0
    assert any(k.startswith("cbserve_spec_decode_acceptance_length_bucket") for k in values)
    assert any(k.startswith("cbserve_spec_decode_num_accepted_tokens_per_pos_total") for k in values)
