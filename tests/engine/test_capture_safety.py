"""What a decode (or speculative verification) CUDA graph captures is capture-safe, checked on CPU.

The padded decode forward (`DecodeBuckets.forward`: the model and the head, logits into the
shared buffer) runs under a `TorchDispatchMode` that logs every torch op with its shapes, with
the Triton kernels replaced by recorders of their grid and specialisation (`triton_keys`) and
the host-read methods that bypass the dispatcher (`Tensor.tolist`, `Tensor.numpy`) trapped.
A capture must not read the device from the host (`.item()`, `.tolist()`, `nonzero`, a
`bool(tensor)`: each is `_local_scalar_dense` or a data-dependent shape), and everything it
allocates and launches must follow the bucket, not the batch: two batches with other real
lengths, contexts and row counts in the same bucket give the same op, shape and launch trace; for
verification graphs (`engine.spec_decode.verify_graphs`) also other draft counts per request.
The weights stay unpacked, as on CUDA (the CPU runner packs them for oneDNN)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.cuda_graphs import check_graph_backend
from engine.kv_cache import allocate_kv_cache
from engine.loader import load_model
from engine.models.causal_lm import CausalLM as LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.presets import resolve_model_dir
from engine.scheduling.output import ScheduledSeq
from kernels import backend
from triton_keys import KeyRecorder

pytest.importorskip("triton")

BLOCK = 16
CPU = torch.device("cpu")
HOST_READS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "is_nonzero", "aten.equal", "item")


class _Trace(TorchDispatchMode):
    """Every torch op: (name, argument shapes/ints, output shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func), _shape(args), _shape(kwargs or {}), _shape(out)))
        return out


def _shape(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), str(x.dtype), tuple(x.stride()))
    if isinstance(x, (list, tuple)):
        return tuple(_shape(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _shape(v)) for k, v in sorted(x.items()))
    return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)) else type(x).__name__


@pytest.fixture(scope="module")
def runner():
    path = resolve_model_dir("tiny")
    cfg = ModelConfig.from_dir(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LlamaForCausalLM, "pack_weights", lambda self: 0)     # plain linears, as on CUDA
        return ModelRunner(load_model(path, cfg, torch.float32, CPU, 4097),
                           allocate_kv_cache(cfg, 64, BLOCK, torch.float32, CPU), BLOCK, CPU, max_num_seqs=16,
                           max_num_batched_tokens=256, max_model_len=4096, enforce_eager=False, verify=(4, 16))


def _decodes(contexts: list[int], first_block: int) -> list[ScheduledSeq]:
    return [ScheduledSeq(f"r{i}", (7 + i,), c - 1, tuple(range(first_block + i, first_block + i + -(-c // BLOCK))), True)
            for i, c in enumerate(contexts)]


def _verifications(contexts: list[int], drafts: list[int], first_block: int) -> list[ScheduledSeq]:
    return [ScheduledSeq(f"r{i}", tuple(range(7 + i, 8 + i + k)), c - 1, tuple(range(first_block + i, first_block + i + -(-(c + k) // BLOCK))), 1 + k)
            for i, (c, k) in enumerate(zip(contexts, drafts))]


def _captured_trace(runner, batch: list[ScheduledSeq], bucket: int, monkeypatch, verify: bool = False) -> tuple[list, list, list]:
    buckets = runner.decode_buckets
    if verify:   # the padded verification step's staging, as `VerifyBuckets.run` does it
        calls = []
        monkeypatch.setattr(buckets, "forward", lambda *args: calls.append(args))
        runner.verify_buckets.run(batch, bucket)
        monkeypatch.undo()
        (t_ids, t_pos, t_meta, out), = calls
    else:
        t = buckets.inputs.prepare(batch, pad_to=bucket, width=buckets.width)     # before the graph, not in it
        t_ids, t_pos, t_meta, out = t.input_ids, t.positions, t.meta, buckets.logits[:bucket]
    reads: list[str] = []
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _o=original, **k: (reads.append(_n), _o(self, *a, **k))[1])
    recorder = KeyRecorder(monkeypatch)
    with torch.inference_mode(), _Trace() as trace:
        buckets.forward(t_ids, t_pos, t_meta, out)
    monkeypatch.undo()
    return trace.ops, recorder.launches, reads


@pytest.fixture
def triton_backend():
    previous = backend.set_backend(backend.TRITON)
    yield
    backend.set_backend(previous)


def test_the_captured_forward_reads_nothing_back_and_follows_the_bucket_only(runner, triton_backend, monkeypatch):
    assert runner.decode_buckets.bucket(_decodes([3, 40, 17, 200, 9], 1)) == 8
    a = _captured_trace(runner, _decodes([3, 40, 17, 200, 9], 1), 8, monkeypatch)
    b = _captured_trace(runner, _decodes([1000, 2, 64, 65, 500, 33, 4000], 20), 8, monkeypatch)
    for ops, launches, reads in (a, b):
        assert not reads, f"host reads in the captured forward: {reads}"
        bad = [op[0] for op in ops if any(name in op[0] for name in HOST_READS)]
        assert not bad, f"host reads in the captured forward: {bad}"
        assert len(ops) > 50 and any("attention" in name for name, _, _ in launches)
    assert a[0] == b[0], "the op/shape trace depends on the batch, not only its bucket"
    assert a[1] == b[1], "the kernel launches (grids, specialisations) depend on the batch"


def test_the_padded_verification_forward_reads_nothing_back_and_follows_the_bucket_only(runner, triton_backend,
                                                                                         monkeypatch):
    """Speculative verification: other contexts, batch sizes and draft counts (0..4) in bucket 8 of
    5-token requests give one trace, with no host read."""
    a_batch = _verifications([3, 40, 17, 200, 9], [4, 0, 2, 1, 4], 1)
    assert runner.verify_buckets.bucket(a_batch) == 8 and runner.decode_buckets.bucket(a_batch) is None
    a = _captured_trace(runner, a_batch, 8, monkeypatch, verify=True)
    b = _captured_trace(runner, _verifications([1000, 2, 64, 65, 500, 33, 3000], [1, 1, 3, 0, 4, 2, 1], 20), 8,
                        monkeypatch, verify=True)
    for ops, launches, reads in (a, b):
        assert not reads, f"host reads in the captured forward: {reads}"
        bad = [op[0] for op in ops if any(name in op[0] for name in HOST_READS)]
        assert not bad, f"host reads in the captured forward: {bad}"
        assert any("attention" in name for name, _, _ in launches)
    assert a[0] == b[0], "the op/shape trace depends on the batch, not only its bucket"
    assert a[1] == b[1], "the kernel launches (grids, specialisations) depend on the batch"
    assert a[0] != _captured_trace(runner, _decodes([3, 40, 17, 200, 9], 1), 8, monkeypatch)[0]   # 40 tokens, not 8


def test_the_torch_reference_reads_the_host_so_graphs_refuse_it(runner, monkeypatch):
    previous = backend.set_backend(backend.TORCH)
    try:
        ops, _, reads = _captured_trace(runner, _decodes([3, 40, 17], 1), 4, monkeypatch)
        assert reads or any(any(name in op[0] for name in HOST_READS) for op in ops)
        with pytest.raises(RuntimeError, match=r"CUDA graphs need the Triton kernels.*CBSERVE_KERNEL_BACKEND=torch"
                                               r".*--enforce-eager"):
            check_graph_backend(CPU)
    finally:
        backend.set_backend(previous)
    backend.set_backend(backend.TRITON)
    try:
        check_graph_backend(CPU)        # the Triton backend: accepted
    finally:
        backend.set_backend(previous)
