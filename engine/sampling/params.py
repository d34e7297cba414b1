"""Per-request sampling parameters: one frozen value, validated once where it enters the system.

Torch-free, because the router imports it to validate HTTP bodies before anything reaches a pod.
The ranges follow OpenAI's API and vLLM. `to_proto`/`from_proto` map it to the wire message
`wire.cbserve_pb2.SamplingParams`; the proto stores floats in 32 bits, so `from_proto` turns
each float back into the shortest decimal that rounds to the same float32 (0.7 stays 0.7), which
makes `from_proto(to_proto(p)) == p` for every value a client can reasonably send.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, fields
from typing import Any

from engine.grammar.spec import StructuredSpec, StructuredSpecError
from engine.grammar.spec import from_proto as structured_from_proto
from engine.grammar.spec import to_proto as structured_to_proto

MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT32_MAX = (1 << 31) - 1
# Below this the sampler treats a request as greedy: dividing logits by a tiny temperature would
# overflow to inf/nan, and the result is argmax anyway (vLLM uses the same cut-off).
GREEDY_TEMPERATURE_EPS = 1e-5


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; `param` names the offending field (for OpenAI's `error.param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token and when to stop. `temperature == 0` means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: off
    min_p: float = 0.0                   # 0: off
    seed: int | None = None              # per-request, deterministic per (seed, output position)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0      # 1: off
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None          # number of top logprobs per token (0: the sampled one only)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredSpec | None = None   # constrained decoding (engine/grammar/spec.py)
    prompt_logprobs: int | None = None   # top logprobs per prompt token (0: the token's own only)

    def __post_init__(self) -> None:
        # Lists (from JSON) become tuples so the value stays hashable and immutable; a lone
        # string for `stop` means one stop string, as in OpenAI's API.
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if isinstance(stop, list):
            stop = tuple(stop)
        object.__setattr__(self, "stop", stop)
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()
        # Derived once, not fields: the engine screens every request's params every step, and an
        # attribute read in a C-level `map` costs a fifth of a Python call doing the comparisons.
        penalized = self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        object.__setattr__(self, "penalized", penalized)   # sampling reads earlier tokens' values
        object.__setattr__(self, "reads_host_tokens", penalized or self.structured is not None)

    def validate(self) -> None:
        """Raise `SamplingParamsError` naming the first field that is out of range."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _check_real(name, getattr(self, name))
        for name in ("top_k", "max_tokens", "min_tokens"):
            _check_int(name, getattr(self, name))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"must be a boolean, got {getattr(self, name)!r}")

        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingParamsError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k > _INT32_MAX:
            raise SamplingParamsError("top_k", f"must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingParamsError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise SamplingParamsError(
                "repetition_penalty", f"must be > 0 (1 = off), got {self.repetition_penalty}")
        if not 1 <= self.max_tokens <= _INT32_MAX:
            raise SamplingParamsError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not _INT64_MIN <= self.seed <= _INT64_MAX:
                raise SamplingParamsError("seed", f"must fit in a signed 64-bit integer, got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise SamplingParamsError(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        self._validate_stops()
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            raise SamplingParamsError("structured", "must be a StructuredSpec")

    def _validate_stops(self) -> None:
        if not isinstance(self.stop_token_ids, tuple):
            raise SamplingParamsError("stop_token_ids", "must be a list of token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(
                "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id <= _INT32_MAX:
                raise SamplingParamsError("stop_token_ids", f"must be non-negative token ids, got {token_id!r}")
        if not isinstance(self.stop, tuple):
            raise SamplingParamsError("stop", "must be a string or a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise SamplingParamsError("stop", f"stop strings must be non-empty strings, got {text!r}")
            if len(text) > MAX_STOP_STRING_CHARS:
                raise SamplingParamsError("stop", f"stop strings are at most {MAX_STOP_STRING_CHARS} characters")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def _check_real(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SamplingParamsError(name, f"must be a finite number, got {value!r}")


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"must be an integer, got {value!r}")


def _from_float32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (undoes the proto's 32-bit storage)."""
    packed = struct.pack("<f", value)
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == packed:
            return candidate
    return value


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_PLAIN_FIELDS = ("top_k", "max_tokens", "min_tokens", "ignore_eos", "skip_special_tokens",
                 "include_stop_str_in_output") + _FLOAT_FIELDS


def to_proto(params: SamplingParams, msg: Any = None) -> Any:
    """Fill (or create) a `cbserve_pb2.SamplingParams` message from `params`; returns the message."""
    if msg is None:
        from wire import cbserve_pb2

        msg = cbserve_pb2.SamplingParams()
    for name in _PLAIN_FIELDS:
        setattr(msg, name, getattr(params, name))
    if params.seed is not None:
        msg.seed = params.seed
    else:
        msg.ClearField("seed")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            setattr(msg, name, getattr(params, name))
        else:
            msg.ClearField(name)
    del msg.stop_token_ids[:]
    msg.stop_token_ids.extend(params.stop_token_ids)
    del msg.stop[:]
    msg.stop.extend(params.stop)
    if params.structured is not None:
        structured_to_proto(params.structured, msg.structured)
    else:
        msg.ClearField("structured")
    return msg


def from_proto(msg: Any) -> SamplingParams:
    """Build and validate `SamplingParams` from a wire message (raises `SamplingParamsError`)."""
    values: dict[str, Any] = {name: getattr(msg, name) for name in _PLAIN_FIELDS}
    for name in _FLOAT_FIELDS:
        values[name] = _from_float32(values[name])
    values["seed"] = msg.seed if msg.HasField("seed") else None
    for name in ("logprobs", "prompt_logprobs"):
        values[name] = getattr(msg, name) if msg.HasField(name) else None
    values["stop_token_ids"] = tuple(msg.stop_token_ids)
    values["stop"] = tuple(msg.stop)
    if msg.HasField("structured"):
        try:
            values["structured"] = structured_from_proto(msg.structured)
        except StructuredSpecError as e:
            raise SamplingParamsError("structured", str(e)) from None
    return SamplingParams(**values)


assert {f.name for f in fields(SamplingParams)} == set(_PLAIN_FIELDS) | {
    "seed", "logprobs", "prompt_logprobs", "stop_token_ids", "stop", "structured"}, \
    "to_proto/from_proto must cover every field"
