"""`Sampler.sample_on_device` reads nothing back from the device; `resolve()` does, once.

On CPU tensors a read is only a load, so the test counts the calls that would be device-to-host
round trips on CUDA: `Tensor.tolist/item/__bool__/__int__/__float__/__index__/nonzero` (patched
on the class) and the ATen ops that copy a device value to the host or size their output by the
data (`_local_scalar_dense`, `nonzero`, `masked_select`, boolean-mask indexing; a dispatch mode).
It runs every batch twice: as the sampler runs on CPU, and with `host_memory` patched to False,
i.e. the formulation used on CUDA, where even numpy views (`Tensor.numpy`) must not occur.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.sampling import random_sampling
from engine.request import Request
from engine.sampling.sampler import DeviceSample, PinnedBuffers, Sampler
from engine.sampling.params import SamplingParams

EOS = 5
aten = torch.ops.aten
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero")
SYNCING_OPS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.unique_consecutive,
               aten._unique2, aten.repeat_interleave}


class _SyncingOps(TorchDispatchMode):
    def __init__(self, hits: list[str]) -> None:
        super().__init__()
        self.hits = hits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in SYNCING_OPS:
            self.hits.append(str(func))
        elif func.overloadpacket in (aten.index, aten.index_put, aten.index_put_) and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ())):
            self.hits.append(f"{func} with a boolean mask")
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_reads(monkeypatch, also_numpy: bool):
    """Yields the list of host reads made inside the block."""
    hits: list[str] = []
    names = READS + (("numpy",) if also_numpy else ())
    with monkeypatch.context() as patch:
        for name in names:
            original = getattr(torch.Tensor, name)

            def counted(self, *args, _name=name, _original=original, **kwargs):
                hits.append(_name)
                return _original(self, *args, **kwargs)
            patch.setattr(torch.Tensor, name, counted)
        with _SyncingOps(hits):
            yield hits


def request(output=(), **params) -> Request:
    r = Request("r", [1, 2, 3, 7, 7], SamplingParams(**params))
    for token in output:
        r.append_output_token(token)
    return r


BATCHES = {
    "greedy": [dict(temperature=0.0)] * 3,
    "temperature": [dict(temperature=0.8)] * 3,
    "top_p": [dict(top_p=0.9)] * 3,
    "top_k": [dict(top_k=5), dict(top_k=40), dict(top_k=1)],
    "large_top_k": [dict(top_k=300), dict(top_k=40)],
    "top_k_top_p": [dict(top_k=20, top_p=0.8)] * 3,
    "min_p": [dict(min_p=0.1), dict(min_p=0.0), dict(min_p=0.3)],
    "seeded": [dict(seed=1), dict(seed=2, top_k=10), dict(seed=3, top_p=0.7, min_p=0.05), dict(seed=4, top_k=300)],
    "mixed": [dict(temperature=0.0, logprobs=2), dict(seed=9, top_k=3, logprobs=0), dict(top_p=0.5),
              dict(temperature=0.0, repetition_penalty=1.3), dict(top_k=7, min_tokens=4, stop_token_ids=(8,)),
              dict(seed=11, presence_penalty=0.5, frequency_penalty=0.3, logprobs=4)],
    "logprobs": [dict(logprobs=3), dict(temperature=0.0, logprobs=1)],
}


def logits_for(n: int, vocab: int = 500) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[:, 100:140] = logits[:, 100:101]          # ties at and past the top-k boundary
    return logits


def _case(batch: str, device_formulation: bool, monkeypatch):
    """(requests, logits, sampler) of a BATCHES case; `device_formulation` makes the CPU take the
    path a GPU takes (no numpy reads of host memory)."""
    if device_formulation:
        monkeypatch.setattr(random_sampling, "host_memory", lambda device: False)
    requests = [request(output=(7, 8), **kw) for kw in BATCHES[batch]]
    return requests, logits_for(len(requests)), Sampler([EOS])


@pytest.mark.parametrize("device_formulation", [False, True], ids=["cpu", "device"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_sample_on_device_reads_nothing_back(batch, device_formulation, monkeypatch):
    requests, logits, sampler = _case(batch, device_formulation, monkeypatch)
    sampler.sample_on_device(logits, requests)          # first call: generators, lazy imports
    with count_reads(monkeypatch, also_numpy=device_formulation) as hits:
        sample = sampler.sample_on_device(logits, requests)
    assert hits == []
    assert sample.token_ids.dtype == torch.int64 and sample.token_ids.shape == (len(requests),)


@pytest.mark.parametrize("device_formulation", [False, True], ids=["cpu", "device"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_resolve_gives_what_sample_gives(batch, device_formulation, monkeypatch):
    requests, logits, sampler = _case(batch, device_formulation, monkeypatch)
    torch.manual_seed(0)                                 # the unseeded rows' draws
    expected = sampler.sample(logits, requests)
    torch.manual_seed(0)
    sample = sampler.sample_on_device(logits, requests)
    assert isinstance(sample, DeviceSample)
    assert sample.resolve() == expected
    assert sample.resolve() is sample.resolve()          # idempotent
    assert sample.token_ids.tolist() == expected.token_ids


def test_the_device_formulation_draws_the_same_seeded_tokens(monkeypatch):
    """Ties, -inf rows and every path: the CPU's data-sized draws and the whole-row draws agree."""
    g = torch.Generator().manual_seed(3)
    vocab = 700
    logits = (torch.randn(12, vocab, generator=g) * 4).round()     # integers: many ties
    logits[3, 10:] = float("-inf")                                  # 10 finite tokens, top-k 40
    settings = [dict(top_k=k, top_p=p, min_p=m, temperature=t) for k, p, m, t in
                [(3, 1.0, 0.0, 1.0), (40, 0.9, 0.0, 0.7), (256, 1.0, 0.05, 1.0), (40, 1.0, 0.0, 1.0),
                 (0, 0.8, 0.0, 1.2), (0, 1.0, 0.0, 1.0), (300, 0.95, 0.0, 1.0), (1, 1.0, 0.0, 1.0),
                 (699, 1.0, 0.0, 1.0), (10, 0.5, 0.2, 0.9), (0, 1.0, 0.3, 1.0), (257, 1.0, 0.0, 1.0)]]
    for position in range(3):
        requests = [request(output=(7,) * position, seed=50 + i, **kw) for i, kw in enumerate(settings)]
        on_cpu = Sampler([EOS]).sample(logits, requests).token_ids
        with monkeypatch.context() as patch:
            patch.setattr(random_sampling, "host_memory", lambda device: False)
            formulated = Sampler([EOS]).sample(logits, requests).token_ids
        alone = [Sampler([EOS]).sample(logits[i:i + 1], [requests[i]]).token_ids[0] for i in range(12)]
        assert on_cpu == formulated == alone


def test_pinned_buffers_are_reused_and_grow():
    pool = PinnedBuffers(pin_memory=False)
    first = pool.take(10, torch.int64)
    assert first.numel() >= 10
    pool.give(first)
    assert pool.take(5, torch.int64) is first            # reused
    second = pool.take(5, torch.int64)                   # `first` is out: a sample in flight
    assert second is not first
    pool.give(first)
    pool.give(second)
    big = pool.take(1000, torch.int64)                   # grows past both
    assert big.numel() >= 1000 and big is not first and big is not second
    assert pool.take(3, torch.float32).dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sample_on_device_never_synchronizes():
    """CUDA's own check: any synchronizing call inside `sample_on_device` raises."""
    device = torch.device("cuda")
    sampler = Sampler([EOS])
    for batch in sorted(BATCHES):
        requests = [request(output=(7, 8), **kw) for kw in BATCHES[batch]]
        logits = logits_for(len(requests), vocab=32000).to(device)
        sampler.sample_on_device(logits, requests).resolve()     # warm-up: allocators, generators
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            first = sampler.sample_on_device(logits, requests)
            second = sampler.sample_on_device(logits.flip(0), requests[::-1])   # two in flight
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert first.token_ids.device == device and first.token_ids.dtype == torch.int64
        one, two = first.resolve(), second.resolve()
        assert one.token_ids == first.token_ids.tolist() and two.token_ids == second.token_ids.tolist()
        seeded = [i for i, kw in enumerate(BATCHES[batch]) if "seed" in kw or kw.get("temperature") == 0.0]
        assert [one.token_ids[i] for i in seeded] == [two.token_ids[len(requests) - 1 - i] for i in seeded]
        expected = sampler.sample(logits, requests)
        assert [one.token_ids[i] for i in seeded] == [expected.token_ids[i] for i in seeded]
        assert [one.logprobs[i] is None for i in range(len(requests))] == \
            [expected.logprobs[i] is None for i in range(len(requests))]
