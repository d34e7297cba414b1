"""1 prefill + 1 decode pod as real processes: disaggregated tokens equal the colocated engine's,
over both transports (gRPC bytes, and a Gloo process group with gRPC as the control plane)."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc
from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from tests.pods.podproc import Pod, disaggregated, pod_channel, pod_pair, run, sampling, vouched

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pods():
    with pod_pair("--kv-transport", "nccl") as pair:
        yield pair


@pytest.fixture(scope="module")
def reference():
    return Engine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=512),
                               scheduler=SchedulerConfig(max_num_batched_tokens=64)))


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [1] + [rng.randrange(4, 260) for _ in range(99)]
    return [
        [1] + [rng.randrange(4, 260) for _ in range(150)],   # longer than the 64-token budget
        [1] + [rng.randrange(4, 260) for _ in range(36)],    # not a multiple of the block size
        [1] + [rng.randrange(4, 260) for _ in range(15)],    # exactly one block
        shared + [rng.randrange(4, 260) for _ in range(33)],  # shared prefix ...
        shared + [rng.randrange(4, 260) for _ in range(7)],   # ... with this one
        [1, 5],                                               # shortest
    ]


PARAMS = {
    "greedy": dict(temperature=0.0, max_tokens=12),
    "seeded": dict(temperature=0.8, top_p=0.9, top_k=40, seed=1234, max_tokens=12),
}


def _assert_indexed(messages) -> None:
    """A message may carry several tokens (all a step left queued): `index` is its first one's."""
    starts = [0]
    for m in messages[:-1]:
        starts.append(starts[-1] + len(m.token_ids))
    assert [m.index for m in messages] == starts
    assert all(m.token_ids for m in messages)


@pytest.mark.parametrize("transport", ["grpc", "nccl"])
@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_disaggregated_equals_colocated(pods, reference, transport, mode):
    prefill, decode = pods
    prompts = _prompts()
    expected = [o.output_token_ids for o in reference.generate(prompts, SamplingParams(**PARAMS[mode]))]

    async def all_at_once():
        return await asyncio.gather(*(
            disaggregated(prefill, decode, f"{transport}-{mode}-{i}", p, sampling(**PARAMS[mode]), transport)
            for i, p in enumerate(prompts)))

    results = run(all_at_once())
    assert [tokens for tokens, _ in results] == expected
    for _, messages in results:
        assert not messages[0].local_prefill           # the KV really came from the prefill pod
        _assert_indexed(messages)
        assert messages[-1].finished and messages[-1].finish_reason == "length"


def test_decode_pod_alone_is_the_colocated_engine(pods, reference):
    _, decode = pods
    prompt = _prompts()[0]
    expected = reference.generate([prompt], SamplingParams(**PARAMS["seeded"]))[0].output_token_ids

    async def local():
        async with pod_channel(decode.address) as ch:
            stream = pb_grpc.DecodeServiceStub(ch).Generate(pb.GenerateRequest(
                request_id="local-0", prompt_token_ids=prompt, sampling=sampling(**PARAMS["seeded"])), timeout=60)
            return [m async for m in stream]

    messages = run(local())
    assert messages[0].local_prefill
    assert [t for m in messages for t in m.token_ids] == expected


def test_stop_strings_end_streams_where_the_engine_ends_them(pods, reference):
    """Pod engines detokenize only requests with stop strings; those still stop on the string."""
    prefill, decode = pods
    prompt = [1] + [random.Random(9).randrange(4, 260) for _ in range(40)]
    free = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30))[0]
    if len(free.text) < 6:
        pytest.skip("the tiny model's text is too short for a stop string")
    params = dict(temperature=0.0, max_tokens=30, stop=[free.text[3:6]])
    want = reference.generate([prompt], SamplingParams(**params))[0]
    assert want.finish_reason == "stop" and len(want.output_token_ids) < len(free.output_token_ids)

    async def both():
        async with pod_channel(decode.address) as ch:
            alone = [m async for m in pb_grpc.DecodeServiceStub(ch).Generate(pb.GenerateRequest(
                request_id="stop-local", prompt_token_ids=prompt, sampling=sampling(**params)), timeout=60)]
        pulled = await disaggregated(prefill, decode, "stop-pulled", prompt, sampling(**params))
        return alone, pulled[1]

    for messages in run(both()):
        assert [t for m in messages for t in m.token_ids] == want.output_token_ids
        assert messages[-1].finished and messages[-1].finish_reason == "stop"
        _assert_indexed(messages)


def _metric(text: str, name: str, role: str) -> float:
    prefix = f'{name}{{role="{role}"}} '
    return sum(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


def test_metrics_exported(pods):
    import urllib.request

    prefill, decode = pods
    run(disaggregated(prefill, decode, "metrics-0", [1] + list(range(10, 60)), sampling(max_tokens=4)))
    for pod in pods:
        text = urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics_port}/metrics", timeout=5).read().decode()
        for name in ("cbserve_requests_running", "cbserve_requests_waiting", "cbserve_prefill_queue_tokens",
                     "cbserve_kv_cache_usage_ratio", "cbserve_prefix_cache_hit_ratio", "cbserve_preemptions_total",
                     "cbserve_step_seconds_bucket", "cbserve_kv_transfer_bytes_total",
                     "cbserve_kv_transfer_seconds_bucket", "cbserve_time_to_first_token_seconds_bucket",
                     "cbserve_kv_lease_expired_total", "cbserve_local_prefill_fallbacks_total"):
            assert name in text, f"{pod.role} lacks {name}"
        assert _metric(text, "cbserve_step_seconds_count", pod.role) > 0, f"{pod.role} times no step"
    decode_text = urllib.request.urlopen(f"http://127.0.0.1:{pods[1].metrics_port}/metrics").read().decode()
    assert 'cbserve_kv_transfer_bytes_total{role="decode"} 0.0' not in decode_text
    # The decode pod's share of the prefill->decode gap: KV pulled -> the second token out.
    assert _metric(decode_text, "cbserve_decode_first_step_seconds_count", "decode") > 0


def test_watch_load_streams_reports(pods):
    async def watch():
        async with pod_channel(pods[0].address) as ch:
            stream = pb_grpc.PrefillServiceStub(ch).WatchLoad(pb.WatchLoadRequest(interval_seconds=0.02), timeout=5)
            reports = []
            async for report in stream:
                reports.append(report)
                if len(reports) == 3:
                    stream.cancel()
                    break
            return reports

    reports = run(watch())
    assert [r.role for r in reports] == ["prefill"] * 3
    assert reports[0].num_total_blocks > 0 and reports[-1].timestamp > reports[0].timestamp


QUANTIZED = {
    # `--quantization int8`: int8 amplifies the float noise of other chunk boundaries (engine/quant.py).
    "int8": (("--quantization", "int8"), {"quantization": "int8"}, {}),
    # `--kv-cache-dtype fp8`: the decode pod receives the prefill pod's e4m3 bytes (the handshake
    # checked dtype and scales); quantizing K/V turns float noise from other batch shapes into a
    # different e4m3 code now and then.
    "fp8kv": (("--kv-cache-dtype", "fp8"), {}, {"kv_cache_dtype": "fp8"}),
}


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantized_pods_equal_the_quantized_colocated_engine(name):
    """Quantized pods: tokens equal a colocated engine's with the same quantization, greedy and
    seeded. Quantization turns float noise from other batch shapes into a different code now and
    then (see QUANTIZED), so both sides must compute the same shapes: requests go one at a time,
    with the pods' token budget on the reference too and prefix caching off, so a prompt's chunks
    start at the same tokens and every decode step is a batch of one on both sides (sent all at
    once, chunk boundaries followed arrival timing and a seeded token flipped under load). A request
    whose pull failed (D then prefills locally) proves nothing about the transfer: it is counted,
    not compared; at most one may."""
    pod_flags, engine_kw, cache_kw = QUANTIZED[name]
    flags = (*pod_flags, "--no-prefix-caching")
    prefill, decode = Pod("prefill", *flags), Pod("decode", *flags)
    try:
        prefill.wait_ready(), decode.wait_ready()
        reference = Engine(EngineConfig(model="tiny", **engine_kw, cache=CacheConfig(
            num_blocks=512, enable_prefix_caching=False, **cache_kw),
            scheduler=SchedulerConfig(max_num_batched_tokens=64)))   # the pods' budget (podproc)
        prompts = [p for i, p in enumerate(_prompts()) if i != 4]  # no shared prefix
        local = 0
        for mode, kw in sorted(PARAMS.items()):
            expected = [reference.generate([p], SamplingParams(**kw))[0].output_token_ids for p in prompts]
            for i, p in enumerate(prompts):
                tokens, messages = run(disaggregated(prefill, decode, f"{name}-{mode}-{i}", p, sampling(**kw)))
                assert messages[-1].finished, (mode, i, decode.log_tail())
                if messages[0].local_prefill:
                    local += 1
                    continue
                assert tokens == expected[i], (mode, i)
        assert local <= 1, decode.log_tail()
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("transport", ["grpc", "nccl"])
def test_prompt_logprobs_come_with_the_first_token_from_both_pods(pods, reference, transport):
    """P scores the prompt and sends the scores with its first token, to the router (its answer) and
    in the KV pull's last chunk (D's first message): whichever reaches the router first carries them."""
    prefill, decode = pods
    prompt = _prompts()[0]                       # 151 tokens: three 64-token chunks on P
    expected = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2))[0]
    params = sampling(temperature=0.0, max_tokens=3, prompt_logprobs=2)

    async def both():
        async with pod_channel(prefill.address) as pc, pod_channel(decode.address) as dc:
            answer = pb_grpc.PrefillServiceStub(pc).Prefill(pb.PrefillRequest(
                request_id=f"plp-{transport}", prompt_token_ids=prompt, sampling=params), timeout=60)
            stream = pb_grpc.DecodeServiceStub(dc).Generate(vouched(pb.GenerateRequest(
                request_id=f"plp-{transport}", prompt_token_ids=prompt, sampling=params,
                prefill_from=prefill.address, kv_transport=transport)), timeout=60)
            return await answer, [m async for m in stream]

    answer, messages = run(both())
    assert not messages[0].local_prefill
    for scores in (answer.prompt_logprobs, messages[0].prompt_logprobs):
        assert scores.num_top == 2 and len(scores.token_logprobs) == len(prompt) - 1
        assert list(scores.token_ranks) == expected.prompt_logprobs.token_ranks
        assert list(scores.top_token_ids) == expected.prompt_logprobs.top_token_ids
        assert list(scores.token_logprobs) == pytest.approx(expected.prompt_logprobs.token_logprobs, abs=1e-5)
    assert not any(m.HasField("prompt_logprobs") for m in messages[1:])
