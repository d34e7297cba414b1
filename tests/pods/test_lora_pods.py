"""LoRA across real prefill and decode pods: disaggregated tokens equal the colocated engine's
for a mix of adapters and the base model (greedy and seeded, both transports); the decode pod
pulls with its adapter identity and a prefill pod whose adapter of that name has other contents
refuses the pull (FAILED_PRECONDITION, never wrong KV); an adapter evicted from host memory is read
back off the engine thread; runtime loading answers every error with its status; load reports and
metrics carry the adapters."""

from __future__ import annotations

import asyncio
import re
import shutil

import grpc
import httpx
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.lora.config import LoRAConfig, LoRAModule
from engine.sampling.params import SamplingParams
from tests.pods.lora_fixtures import lora_pod_args, tiny_adapters
from tests.pods.podproc import AUTH, Pod, disaggregated, pod_channel, run, sampling
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
PARAMS = {"greedy": dict(temperature=0.0, max_tokens=10, ignore_eos=True),
          "seeded": dict(temperature=0.8, top_p=0.9, seed=4321, max_tokens=10, ignore_eos=True)}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return root, tiny_adapters(root)


@pytest.fixture(scope="module")
def pods(adapters):
    root, paths = adapters
    # The decode pod has one slot and keeps one adapter in host memory: the two adapters of a
    # batch take turns in the slot, and each switch reads the other back from disk.
    prefill = Pod("prefill", "--kv-transport", "nccl", *lora_pod_args(paths, root))
    decode = Pod("decode", "--kv-transport", "nccl", *lora_pod_args(paths, root, max_loras=1, max_cpu_loras=1))
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="module")
def reference(adapters):
    _, paths = adapters
    return Engine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=512),
                               scheduler=SchedulerConfig(max_num_batched_tokens=64),
                               lora=LoRAConfig(max_loras=2, lora_modules=(LoRAModule("sql", str(paths["sql"])),
                                                                          LoRAModule("chat", str(paths["chat"]))))))


def _jobs():
    prompts = [[1] + [(7 * i + 3 * j) % 250 + 4 for j in range(n)] for i, n in enumerate((70, 20, 33, 9, 48, 15))]
    return list(zip(["sql", None, "chat", "sql", "chat", None], prompts))


def _with_lora(request, name):
    request.lora_name = name or ""
    return request


async def _disaggregated_lora(prefill, decode, request_id, prompt, params, lora, transport="grpc"):
    async with pod_channel(prefill.address) as pc, pod_channel(decode.address) as dc:
        from tests.pods.podproc import vouched
        pre = pb_grpc.PrefillServiceStub(pc).Prefill(_with_lora(
            pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=params), lora), timeout=60)
        gen = pb_grpc.DecodeServiceStub(dc).Generate(vouched(_with_lora(
            pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=params,
                               prefill_from=prefill.address, kv_transport=transport), lora)), timeout=60)
        messages = [m async for m in gen]
        await pre
    return [t for m in messages for t in m.token_ids], messages


@pytest.mark.parametrize("transport", ["grpc", "nccl"])
@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_disaggregated_equals_colocated_with_adapters(pods, reference, transport, mode):
    prefill, decode = pods
    jobs = _jobs()
    expected = [o.output_token_ids for o in reference.generate([p for _, p in jobs], SamplingParams(**PARAMS[mode]),
                                                                lora=[a for a, _ in jobs])]
    base = [o.output_token_ids for o in reference.generate([p for _, p in jobs], SamplingParams(**PARAMS[mode]))]
    assert all(e != b for (a, _), e, b in zip(jobs, expected, base) if a), "adapters should change the tokens"

    async def all_at_once():
        return await asyncio.gather(*(_disaggregated_lora(prefill, decode, f"{transport}-{mode}-{i}", p,
                                                          sampling(**PARAMS[mode]), a, transport)
                                      for i, (a, p) in enumerate(jobs)))

    results = run(all_at_once())
    assert [tokens for tokens, _ in results] == expected
    assert all(not messages[0].local_prefill for _, messages in results)   # the KV came from the prefill pod


def _load(address, role, name, path):
    with grpc.insecure_channel(address) as ch:
        stub = (pb_grpc.PrefillServiceStub if role == "prefill" else pb_grpc.DecodeServiceStub)(ch)
        return stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=str(path)), timeout=60,
                                    metadata=AUTH)


def _unload(address, role, name):
    with grpc.insecure_channel(address) as ch:
        stub = (pb_grpc.PrefillServiceStub if role == "prefill" else pb_grpc.DecodeServiceStub)(ch)
        return stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name=name), timeout=60, metadata=AUTH)


def test_a_pull_under_another_adapter_identity_is_refused(pods, adapters, tmp_path):
    root, paths = adapters
    prefill, decode = pods
    _load(prefill.address, "prefill", "twin", paths["sql"])    # same name, other files on each pool
    _load(decode.address, "decode", "twin", paths["chat"])
    try:
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            run(_disaggregated_lora(prefill, decode, "twin-0", [1, 5, 9, 13, 17], sampling(**PARAMS["greedy"]),
                                    "twin"))
        assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "LoRA adapter" in failure.value.details() and "not usable" in failure.value.details()
    finally:
        _unload(prefill.address, "prefill", "twin")
        _unload(decode.address, "decode", "twin")
    prefill.wait_free_blocks(prefill.load().num_total_blocks, timeout=30)   # nothing leaked on either pod
    decode.wait_free_blocks(decode.load().num_total_blocks, timeout=30)


def test_unknown_adapter_is_not_found_on_both_pods(pods):
    prefill, decode = pods
    with grpc.insecure_channel(prefill.address) as pc, grpc.insecure_channel(decode.address) as dc:
        calls = [lambda: pb_grpc.PrefillServiceStub(pc).Prefill(pb.PrefillRequest(
                     request_id="unknown-p", prompt_token_ids=[1, 2, 3], sampling=sampling(max_tokens=2),
                     lora_name="nonexistent"), timeout=30, metadata=AUTH),
                 lambda: list(pb_grpc.DecodeServiceStub(dc).Generate(pb.GenerateRequest(
                     request_id="unknown-d", prompt_token_ids=[1, 2, 3], sampling=sampling(max_tokens=2),
                     lora_name="nonexistent"), timeout=30, metadata=AUTH))]
        for call in calls:
            with pytest.raises(grpc.RpcError) as failure:
                call()
            assert failure.value.code() == grpc.StatusCode.NOT_FOUND and "nonexistent" in failure.value.details()


def test_runtime_loading_errors_and_the_adapters_in_load_reports(pods, adapters, tmp_path):
    root, paths = adapters
    prefill, decode = pods
    outside = shutil.copytree(paths["extra"], tmp_path / "outside")
    broken = shutil.copytree(paths["extra"], root / "broken")
    (broken / "adapter_config.json").write_text('{"r": 64, "lora_alpha": 8}')
    cases = [("escape", outside, grpc.StatusCode.PERMISSION_DENIED, "outside --lora-root"),
             ("big", broken, grpc.StatusCode.INVALID_ARGUMENT, "exceeds --max-lora-rank 16"),
             ("sql", paths["extra"], grpc.StatusCode.ALREADY_EXISTS, "already loaded"),
             ("a b", paths["extra"], grpc.StatusCode.INVALID_ARGUMENT, "without spaces")]
    for name, path, code, message in cases:
        with pytest.raises(grpc.RpcError) as failure:
            _load(decode.address, "decode", name, path)
        assert failure.value.code() == code and message in failure.value.details()
    with pytest.raises(grpc.RpcError) as failure:
        _unload(prefill.address, "prefill", "never")
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND

    identity = _load(decode.address, "decode", "extra", "extra").identity     # relative to --lora-root
    try:
        report = decode.load()        # the server's report lists it as soon as the call returns
        assert report.max_loras == 1
        names = {a.name: a for a in report.lora_adapters}
        assert set(names) == {"sql", "chat", "extra"} and names["extra"].identity == identity
        assert names["extra"].registered and not names["extra"].resident
        page = httpx.get(f"http://127.0.0.1:{decode.metrics_port}/metrics", timeout=5).text
        assert re.search(r'cbserve_lora_requests_info\{[^}]*max_lora="1"', page)
        assert re.search(r'cbserve_lora_adapters\{role="decode",state="registered"\} 3\.0', page)
    finally:
        _unload(decode.address, "decode", "extra")
    assert "extra" not in {a.name for a in decode.load().lora_adapters}
