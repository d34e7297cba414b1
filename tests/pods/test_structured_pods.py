"""Structured outputs across real prefill and decode pod processes talking gRPC.

The prefill pod samples token 0 under the grammar and hands it over with the grammar's
fingerprint; the decode pod, which compiled the same grammar meanwhile, accepts that token once
and goes on: the tokens equal the colocated engine's, greedy and seeded, `n > 1` included. A
forged fingerprint or first token (the prefill pod's test fault hook) makes the decode pod
prefill locally instead — same tokens again, never an unconstrained one — and counts it.
"""

from __future__ import annotations

import asyncio
import random
import re
import urllib.request

import grpc
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.grammar.spec import StructuredSpec
from engine.sampling.params import SamplingParams
from prefill_pod.core import FAULT_FIRST_TOKEN_ENV
from tests.engine.structured_cases import SMALL_SPECS, check_complete, choice_spec, regex_spec
from tests.pods.podproc import Pod, disaggregated, pod_channel, run, sampling, vouched
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pods():
    prefill = Pod("prefill", env={FAULT_FIRST_TOKEN_ENV: "1"})   # forges only "forge-*" requests
    decode = Pod("decode")
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="module")
def reference():
    return Engine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=512),
                               scheduler=SchedulerConfig(max_num_batched_tokens=64)))


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(4, 260) for _ in range(n - 1)]


def _requests() -> list[tuple[str, list[int], dict]]:
    """(id, prompt, sampling) of one batch: every kind, greedy and seeded, one request with n=2
    (the router's fan-out: one request per choice, seed + j)."""
    out = []
    for k, (name, spec) in enumerate(sorted(SMALL_SPECS.items())):
        prompt = _prompt(k, 10 + 40 * k)           # 10..90 tokens: one chunk, or several of 64
        out.append((f"{name}-greedy", prompt, dict(temperature=0.0, max_tokens=48, structured=spec)))
        for j in range(2):
            out.append((f"{name}-seeded-{j}", prompt, dict(temperature=1.0, top_p=0.95, seed=7 + j,
                                                           max_tokens=48, structured=spec)))
    out.append(("free", _prompt(9, 20), dict(temperature=0.8, seed=3, max_tokens=10)))
    return out


def _metric(pod: Pod, name: str, label: str = "") -> float:
    """The sum of `name`'s samples (those whose labels contain `label`) on the pod's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def test_disaggregated_equals_colocated(pods, reference):
    prefill, decode = pods
    requests = _requests()
    want = reference.generate([p for _, p, _ in requests], [SamplingParams(**kw) for _, _, kw in requests])

    async def all_at_once():
        return await asyncio.gather(*(disaggregated(prefill, decode, rid, p, sampling(**kw))
                                      for rid, p, kw in requests))

    results = run(all_at_once())
    for (rid, _, kw), (tokens, messages), expected in zip(requests, results, want):
        assert tokens == expected.output_token_ids, rid
        assert not messages[0].local_prefill, rid                  # token 0 came from the prefill pod
        assert messages[-1].finish_reason == expected.finish_reason, rid
        if kw.get("structured") is not None and expected.finish_reason == "stop":
            check_complete(kw["structured"], reference.tokenizer.decode(tokens))
    assert _metric(decode, "cbserve_structured_output_requests_total") >= 9
    assert _metric(prefill, "cbserve_structured_output_compile_seconds_count") >= 1


def test_prefill_pod_names_the_grammar_of_its_first_token(pods):
    prefill, _ = pods

    async def ask(rid, params):
        async with pod_channel(prefill.address) as channel:
            return await pb_grpc.PrefillServiceStub(channel).Prefill(
                pb.PrefillRequest(request_id=rid, prompt_token_ids=_prompt(3, 9), sampling=sampling(**params)),
                timeout=60)

    constrained = run(ask("fp-a", dict(temperature=0.0, structured=SMALL_SPECS["regex"])))
    again = run(ask("fp-b", dict(temperature=1.0, seed=4, structured=SMALL_SPECS["regex"])))
    free = run(ask("fp-c", dict(temperature=0.0)))
    assert re.fullmatch("[0-9a-f]{64}", constrained.grammar_fingerprint)
    assert again.grammar_fingerprint == constrained.grammar_fingerprint and free.grammar_fingerprint == ""
    assert 4 + ord("A") <= constrained.first_token_id <= 4 + ord("Z")   # byte-level: [A-Z] starts the regex


def test_the_grammar_starts_after_a_marker_reached_on_the_decode_pod(pods, reference):
    prefill, decode = pods
    prompt = _prompt(21, 15)
    free = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    spec = regex_spec("[0-9]{4}", after_token_ids=tuple(free.output_token_ids[2:4]))   # tokens 2-3: on D
    params = dict(temperature=0.0, max_tokens=30, structured=spec)
    want = reference.generate([prompt], SamplingParams(**params))[0]
    tokens, messages = run(disaggregated(prefill, decode, "marker", prompt, sampling(**params)))
    assert tokens == want.output_token_ids and tokens[:4] == free.output_token_ids[:4]
    assert re.fullmatch("[0-9]{4}", reference.tokenizer.decode(tokens[4:])) and messages[-1].finish_reason == "stop"


def test_a_first_token_that_completes_the_grammar(pods, reference):
    prefill, decode = pods
    params = dict(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True, structured=choice_spec(["a", "b"]))
    want = reference.generate([_prompt(22, 12)], SamplingParams(**params))[0]
    tokens, messages = run(disaggregated(prefill, decode, "one-token", _prompt(22, 12), sampling(**params)))
    assert tokens == want.output_token_ids and len(tokens) == 1
    assert messages[-1].finished and messages[-1].finish_reason == "stop"


@pytest.mark.parametrize("fault", ["fingerprint", "token"])
def test_a_refused_first_token_is_prefilled_locally(pods, reference, fault):
    prefill, decode = pods
    spec = SMALL_SPECS["regex"]                    # starts with [A-Z]: the bos token (1) is refused
    rid = "forge-fingerprint-0" if fault == "fingerprint" else "forge-token-1-0"
    params = dict(temperature=1.0, seed=8, max_tokens=30, structured=spec)
    want = reference.generate([_prompt(23, 30)], SamplingParams(**params))[0]
    name = "cbserve_structured_output_first_token_rejected_total"
    before = _metric(decode, name, f'reason="{fault}"')
    tokens, messages = run(disaggregated(prefill, decode, rid, _prompt(23, 30), sampling(**params)))
    assert messages[0].local_prefill and tokens == want.output_token_ids
    check_complete(spec, reference.tokenizer.decode(tokens))
    assert _metric(decode, name, f'reason="{fault}"') == before + 1
    decode.wait_free_blocks(decode.load().num_total_blocks, timeout=30)   # the refused KV was freed


def test_a_grammar_that_does_not_compile_fails_on_both_pods(pods):
    prefill, decode = pods
    params = sampling(max_tokens=8, structured=StructuredSpec("lark", "start: nowhere"))
    prompt = _prompt(24, 10)

    async def both():
        async with pod_channel(prefill.address) as pc, pod_channel(decode.address) as dc:
            pre = pb_grpc.PrefillServiceStub(pc).Prefill(
                pb.PrefillRequest(request_id="bad", prompt_token_ids=prompt, sampling=params), timeout=60)
            gen = pb_grpc.DecodeServiceStub(dc).Generate(vouched(pb.GenerateRequest(
                request_id="bad", prompt_token_ids=prompt, sampling=params, prefill_from=prefill.address)),
                timeout=60)
            errors = []
            for call in (pre, gen):
                try:
                    await call if call is pre else [m async for m in call]
                except grpc.aio.AioRpcError as e:
                    errors.append(e)
            return errors

    pre_error, gen_error = run(both())
    assert gen_error.code() == grpc.StatusCode.INVALID_ARGUMENT and "nowhere" in gen_error.details()
    # The prefill pod refuses the grammar itself, unless the decode pod refused first and so ended
    # its KV pull: a race both ways round (the pods compile at once), each a clear end.
    if pre_error.code() == grpc.StatusCode.ABORTED:
        assert "pull ended early" in pre_error.details(), pre_error.details()
    else:
        assert pre_error.code() == grpc.StatusCode.INVALID_ARGUMENT and "nowhere" in pre_error.details()
