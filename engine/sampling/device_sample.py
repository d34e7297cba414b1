"""A step's sampled ids (and logprobs) while they are still on the device, and their one read back.

`Sampler.sample_on_device` ends here: the ids stay on the device (the next step's inputs can use
them there) while a non-blocking copy into reused pinned memory and an event are queued behind the
sampling kernels; `DeviceSample.resolve()` waits for that event only, not for anything queued
later (the next step), and turns the copy into host values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the `logprobs` most likely tokens (id, logprob)."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class SamplerOutput:
    token_ids: list[int]                       # one per sequence, in the order of `requests`
    logprobs: list[TokenLogprobs | None]       # None where the request did not ask for logprobs


@dataclass(frozen=True)
class _DeviceLogprobs:
    """Logprobs of some rows, still on the device: `values[j]` holds row `rows[j]`'s sampled-token
    logprob, then its `max_top` best logprobs, then their ids (fp32: exact for ids below 2**24)."""

    rows: tuple[int, ...]
    num_top: tuple[int, ...]          # how many of the best each row asked for
    max_top: int
    values: torch.Tensor              # [len(rows), 1 + 2 * max_top] fp32


def device_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int], rows: list[int],
                     device_rows: torch.Tensor | None) -> _DeviceLogprobs:
    """Raw log-probabilities (before penalties and temperature, vLLM's default) of `rows`
    (`device_rows`: the same on the device, None when that is every row)."""
    if device_rows is None:
        logprobs, sampled_ids = raw_logits.log_softmax(dim=-1), token_ids  # [n, vocab], [n]
    else:
        logprobs, sampled_ids = raw_logits[device_rows].log_softmax(dim=-1), token_ids[device_rows]
    columns = [logprobs.gather(1, sampled_ids[:, None])]
    max_top = min(max(num_top), logprobs.shape[1])
    if max_top:
        columns.extend(logprobs.topk(max_top, dim=-1))  # values, ids: [n, max_top], most likely first
    return _DeviceLogprobs(tuple(rows), tuple(num_top), max_top, torch.cat(columns, dim=1))


class PinnedBuffers:
    """Pinned host memory for device-to-host copies, reused: `take` hands out a buffer of at least
    `numel` elements, `give` takes it back once its contents were read. A sample still in flight
    keeps its own, so two steps in flight never share one; sizes grow by powers of two."""

    def __init__(self, pin_memory: bool = True) -> None:
        self.pin_memory = pin_memory
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.setdefault(dtype, [])
        while free:
            buffer = free.pop()
            if buffer.numel() >= numel:
                return buffer
        return torch.empty(max(64, 1 << (numel - 1).bit_length()), dtype=dtype, pin_memory=self.pin_memory)

    def give(self, buffer: torch.Tensor) -> None:
        self._free.setdefault(buffer.dtype, []).append(buffer)


class DeviceSample:
    """One step's sampled ids, still on the device (`Sampler.sample_on_device`).

    `token_ids` (`[num_seqs]` int64 on the logits' device) can feed the next step directly;
    `resolve()` reads them (and the logprobs) back once. On CUDA the copy into pinned host memory
    was queued right after the sampling kernels, followed by an event: `resolve()` waits for that
    event only, not for whatever was queued later (the next step)."""

    __slots__ = ("token_ids", "_logprobs", "_output", "_pinned", "_staged", "_ready")

    def __init__(self, token_ids: torch.Tensor, logprobs: _DeviceLogprobs | None) -> None:
        self.token_ids = token_ids
        self._logprobs = logprobs
        self._output: SamplerOutput | None = None
        self._pinned: PinnedBuffers | None = None
        self._staged: list[torch.Tensor] = []     # pinned buffers being copied into, then read
        self._ready: torch.cuda.Event | None = None

    @classmethod
    def start(cls, token_ids: torch.Tensor, logprobs: _DeviceLogprobs | None, pinned: PinnedBuffers) -> DeviceSample:
        """Wrap a step's results; on CUDA, queue their copy to the host and an event after it."""
        sample = cls(token_ids, logprobs)
        if token_ids.is_cuda:
            sample._pinned = pinned
            sources = [token_ids] + ([] if logprobs is None else [logprobs.values])
            for source in sources:
                buffer = pinned.take(source.numel(), source.dtype)
                buffer[: source.numel()].view(source.shape).copy_(source, non_blocking=True)
                sample._staged.append(buffer)
            sample._ready = torch.cuda.Event()
            sample._ready.record(torch.cuda.current_stream(token_ids.device))
        return sample

    def resolve(self) -> SamplerOutput:
        """The sampled ids and logprobs on the host: the one device-to-host read of a step.
        Idempotent: later calls return the same output."""
        if self._output is not None:
            return self._output
        logprobs = self._logprobs
        if self._ready is not None:
            self._ready.synchronize()
            num_seqs = self.token_ids.numel()
            token_ids = self._staged[0][:num_seqs].tolist()
            values = None if logprobs is None else self._staged[1][: logprobs.values.numel()].view(
                logprobs.values.shape).tolist()
            for buffer in self._staged:
                self._pinned.give(buffer)
            self._staged = []
        else:
            token_ids = self.token_ids.tolist()
            values = None if logprobs is None else logprobs.values.tolist()
        result: list[TokenLogprobs | None] = [None] * len(token_ids)
        if logprobs is not None:
            m = logprobs.max_top
            for row, n, entry in zip(logprobs.rows, logprobs.num_top, values):
                top_ids, top_values = entry[1 + m: 1 + m + n], entry[1: 1 + n]
                result[row] = TokenLogprobs(logprob=entry[0], top=tuple(zip(map(int, top_ids), top_values)))
        self._output = SamplerOutput(token_ids=token_ids, logprobs=result)
        self._logprobs = None
        return self._output
