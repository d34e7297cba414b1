"""Sliding-window models in P/D: 1 prefill + 1 decode pod as real processes give the colocated
engine's tokens (greedy and seeded, gRPC and Gloo transports) for prompts longer than the window.

The Mistral checkpoint windows every layer, so the prefill pod frees the blocks behind the window
as its chunked prefill goes on, a pull moves only the blocks the decode pod's first query reads
(bytes counted on both pods), the decode pod reserves only those, and frees more as it decodes.
Gemma 3 and gpt-oss mix local and global layers: both pods run KV groups (one layer per page
here), a pull moves the global layer's page of every block and each local layer's pages from its
window's start, and the decode pod reserves exactly those (`kvtransfer.kv_groups`). Both pods
advertise the per-layer windows and the groups in the KV layout handshake (a pod with other groups
is refused), and every page is free again at the end on both, also after a decode pod cancels
mid-transfer; a tensor-parallel prefill pod sends the same pages, gathered from its ranks.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request

import grpc
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from kvtransfer.layout import KVLayout
from tests.engine.hf_window_models import make_window_model
from tests.pods.podproc import AUTH, Pod, disaggregated, pod_channel, pod_pair, run, sampling, vouched
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

NUM_BLOCKS = 128
ARGS = ("--block-size", "4", "--num-blocks", str(NUM_BLOCKS))


@pytest.fixture(scope="module", params=["mistral_window", "gemma3", "gpt_oss"])
def setup(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_window_model(request.param, path)
    reference = Engine(EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=NUM_BLOCKS),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    with pod_pair("--model", str(path), "--kv-transport", "nccl", *ARGS) as (prefill, decode):
        # Free pages when idle: with KV groups `--num-blocks` is whole-model blocks' memory, in pages.
        capacity = prefill.load().num_free_blocks
        assert decode.load().num_free_blocks == capacity
        yield request.param, prefill, decode, reference, capacity, path


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(3, 300) for _ in range(40)]
    return [
        [rng.randrange(3, 300) for _ in range(90)],        # longer than the 64-token budget, > 10 windows
        [rng.randrange(3, 300) for _ in range(23)],        # not a multiple of the block size
        shared + [rng.randrange(3, 300) for _ in range(9)],   # a shared prefix ...
        shared + [rng.randrange(3, 300) for _ in range(17)],  # ... with this one
        [5, 6],
    ]


def _sent_pages(reference: Engine, num_prompt_tokens: int) -> int:
    """What a pull moves (and the decode pod reserves), counted from the model's windows: every
    layer windowed (Mistral), the whole-model blocks from the one holding the first decode query's
    window edge on; mixed (Gemma 3, gpt-oss: one layer per page), each layer's pages from its own
    window's edge on (a full layer's: all)."""
    cfg, bs = reference.model_config, 4
    num_blocks = -(-num_prompt_tokens // bs)

    def first(window: int) -> int:
        return max(0, num_prompt_tokens - window + 1) // bs if window else 0
    if cfg.kv_free_window:
        return num_blocks - first(cfg.kv_free_window)
    return sum(num_blocks - first(window) for window in cfg.layer_windows)


def _kv_bytes(pod) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics_port}/metrics", timeout=5).read().decode()
    prefix = f'cbserve_kv_transfer_bytes_total{{role="{pod.role}"}} '
    return sum(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


def _model_info(pod) -> pb.ModelInfo:
    with grpc.insecure_channel(pod.address) as channel:
        return pb_grpc.DecodeServiceStub(channel).Handshake(pb.HandshakeRequest(), timeout=10, metadata=AUTH).model


def _page_bytes(pod) -> int:
    """Bytes of what one message's block is: a whole-model block, or with KV groups one page."""
    return KVLayout.from_model_info(_model_info(pod)).bytes_per_block


PARAMS = {
    "greedy": dict(temperature=0.0, max_tokens=24),
    "seeded": dict(temperature=0.8, top_p=0.9, seed=99, max_tokens=24),
}


@pytest.mark.parametrize("transport", ["grpc", "nccl"])
@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_disaggregated_equals_colocated_with_windows(setup, transport, mode):
    name, prefill, decode, reference, capacity, _ = setup
    prompts = _prompts()
    expected = [o.output_token_ids for o in reference.generate(prompts, SamplingParams(**PARAMS[mode]))]
    bytes_before = _kv_bytes(prefill), _kv_bytes(decode)

    async def all_at_once():
        return await asyncio.gather(*(
            disaggregated(prefill, decode, f"{name}-{transport}-{mode}-{i}", p, sampling(**PARAMS[mode]), transport)
            for i, p in enumerate(prompts)))

    results = run(all_at_once())
    assert [tokens for tokens, _ in results] == expected
    assert all(not messages[0].local_prefill for _, messages in results)   # the KV came from the prefill pod
    prefill.wait_free_blocks(capacity, timeout=30)
    decode.wait_free_blocks(capacity, timeout=30)
    # Mistral (window 9, blocks of 4): the 90-token prompt moves 3 blocks, not 23. Gemma 3 (4 local
    # layers, window 7, + 1 global): 23 global pages + 2 per local layer = 31 pages, not 23 x 5;
    # gpt-oss (2 sliding, window 6, + 1 full): 23 + 2 x 2.
    sent = sum(_sent_pages(reference, len(p)) for p in prompts)
    assert sent == {"mistral_window": 13, "gemma3": 102, "gpt_oss": 76}[name]
    sent_bytes = sent * _page_bytes(decode)
    assert (_kv_bytes(prefill) - bytes_before[0], _kv_bytes(decode) - bytes_before[1]) == (sent_bytes, sent_bytes)


def test_cancel_mid_transfer_frees_both_pods_and_each_holds_the_window(setup):
    """The decode pod reserves a 500-token prompt's pages before the prefill pod has it (Mistral: 2
    blocks of 125; Gemma 3: 125 global pages + 2 per local layer, 133 of the 625 it held before KV
    groups in P/D); the prefill pod then runs it in 64-token chunks holding at most the window and a
    chunk per windowed group (Mistral: 19 blocks, not 125; Gemma 3: 125 + 4 x 19 pages), and the
    decode pod cancels while the KV is on its way: no page stays taken on either pod."""
    name, prefill, decode, reference, capacity, _ = setup
    prompt = [random.Random(5).randrange(3, 300) for _ in range(500)]
    held_bound = {"mistral_window": 19, "gemma3": 125 + 4 * 19, "gpt_oss": 125 + 2 * 19}[name]
    reserved = _sent_pages(reference, len(prompt))
    assert reserved == {"mistral_window": 2, "gemma3": 133, "gpt_oss": 129}[name]

    async def scenario():
        async with pod_channel(prefill.address) as pc, pod_channel(decode.address) as dc:
            gen = pb_grpc.DecodeServiceStub(dc).Generate(vouched(pb.GenerateRequest(
                request_id=f"{name}-cancel", prompt_token_ids=prompt, sampling=sampling(max_tokens=8),
                prefill_from=prefill.address, kv_transport="nccl")), timeout=30)
            reading = asyncio.ensure_future(gen.read())
            await asyncio.to_thread(decode.wait_free_blocks, capacity - reserved, 30)   # the pull waits for its prefill
            pre = pb_grpc.PrefillServiceStub(pc).Prefill(pb.PrefillRequest(
                request_id=f"{name}-cancel", prompt_token_ids=prompt, sampling=sampling(max_tokens=8)), timeout=30)
            for _ in range(4):      # while it prefills (or its KV is held for the pull)
                report = await asyncio.to_thread(prefill.load)
                assert capacity - report.num_free_blocks <= held_bound
            gen.cancel()
            await asyncio.gather(reading, pre, return_exceptions=True)

    run(scenario())
    prefill.wait_free_blocks(capacity, timeout=30)
    decode.wait_free_blocks(capacity, timeout=30)


def test_a_pod_with_other_kv_groups_is_refused(setup):
    """The handshake carries the KV groups: a peer that runs other groups (one group, as a pod
    with speculative decoding or from before P/D with groups does; or groups where there are
    none) is refused with FAILED_PRECONDITION naming them, on both pods, never paired."""
    name, prefill, decode, *_ = setup
    ours = _model_info(decode)
    assert (list(ours.kv_group_windows), ours.kv_page_slots) == {
        "mistral_window": ([], 0), "gemma3": ([0, 7, 7, 7, 7], 1), "gpt_oss": ([0, 6, 6], 1)}[name]
    theirs = pb.ModelInfo()
    theirs.CopyFrom(ours)
    if ours.kv_group_windows:
        del theirs.kv_group_windows[:]
        theirs.kv_page_slots = 0
    else:
        theirs.kv_group_windows.extend([0, 9])
    for pod, stub in ((prefill, pb_grpc.PrefillServiceStub), (decode, pb_grpc.DecodeServiceStub)):
        with grpc.insecure_channel(pod.address) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                stub(channel).Handshake(pb.HandshakeRequest(model=theirs), timeout=10, metadata=AUTH)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "kv_group_windows" in refused.value.details()


def test_a_tensor_parallel_prefill_pod_sends_the_same_pages(setup):
    """A TP=2 prefill pod (Gloo ranks) gathers each group's pages from its ranks (whole heads per
    page) for a TP=1 decode pod: the colocated tokens, the same bytes as at TP=1."""
    name, _, decode, reference, capacity, path = setup
    if name != "gemma3":
        pytest.skip("one mixed model is enough for the gather path (each TP pod costs ranks)")
    prompts = _prompts()[:2]
    expected = [o.output_token_ids for o in reference.generate(prompts, SamplingParams(**PARAMS["greedy"]))]
    prefill = Pod("prefill", "--model", str(path), "--tensor-parallel-size", "2", *ARGS)
    try:
        prefill.wait_ready(timeout=300)
        before = _kv_bytes(decode)

        async def both():
            return await asyncio.gather(*(disaggregated(prefill, decode, f"{name}-tp-{i}", p,
                                                        sampling(**PARAMS["greedy"])) for i, p in enumerate(prompts)))
        results = run(both())
        assert [tokens for tokens, _ in results] == expected
        assert all(not messages[0].local_prefill for _, messages in results)
        sent = sum(_sent_pages(reference, len(p)) for p in prompts)
        assert _kv_bytes(decode) - before == sent * _page_bytes(decode)
        prefill.wait_free_blocks(capacity, timeout=30)
        decode.wait_free_blocks(capacity, timeout=30)
    finally:
        prefill.stop()
