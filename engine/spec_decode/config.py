"""`--speculative-config JSON`: vLLM's flag and keys, parsed and checked at the boundary.

Torch-free (the CLI, `cbserve up` and the chart's tests read it). Methods:
- `ngram` (prompt lookup): `num_speculative_tokens`, `prompt_lookup_min`, `prompt_lookup_max`
  (vLLM's defaults: both 5 when both are omitted, one copies the other when only one is given);
- `draft_model`: `model` (a preset name or a local HF directory on the target's tokenizer),
  `num_speculative_tokens`;
- `eagle` / `eagle3` / `mtp` are refused by name: their draft heads read the target's hidden
  states, which this engine does not hand out (see `docs/architecture.md`, speculative decoding).

Optional keys: `disable_by_batch_size` (vLLM's: no speculation from this many running requests
on; the measured off-switch in `engine.spec_decode.adaptive` applies below it too) and
`draft_tensor_parallel_size` (only 1: the draft runs unsharded on rank 0).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
REFUSED_METHODS = {
    "eagle": "EAGLE heads read the target's hidden states",
    "eagle3": "EAGLE-3 heads read three of the target's hidden-state layers",
    "mtp": "MTP heads read the target's hidden states",
    "medusa": "Medusa heads read the target's hidden states",
    "mlp_speculator": "MLP speculators read the target's hidden states",
    "suffix": "suffix decoding needs arctic-inference",
}
MAX_SPECULATIVE_TOKENS = 16       # verification rows per request; vLLM caps at 32
DEFAULT_PROMPT_LOOKUP = 5
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
         "disable_by_batch_size", "draft_tensor_parallel_size"}


class SpeculativeConfigError(ValueError):
    """A `--speculative-config` that cannot run; the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP     # ngram: shortest suffix to look up
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP     # ngram: longest suffix to look up
    model: str | None = None                           # draft_model: the draft's directory or preset
    disable_by_batch_size: int | None = None           # no speculation from this many running requests

    def __post_init__(self) -> None:
        if self.method in REFUSED_METHODS:
            raise SpeculativeConfigError(
                f"speculative method {self.method!r} is not supported: {REFUSED_METHODS[self.method]}, which "
                f"this engine does not expose to a proposer; use one of {METHODS}")
        if self.method not in METHODS:
            raise SpeculativeConfigError(f"method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                                         f"got {self.num_speculative_tokens}")
        if self.method == "ngram":
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise SpeculativeConfigError(
                    f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} and "
                    f"{self.prompt_lookup_max}")
            if self.model is not None:
                raise SpeculativeConfigError("model is for method 'draft_model', not 'ngram'")
        elif not self.model:
            raise SpeculativeConfigError("method 'draft_model' needs model (a preset name or a model directory)")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise SpeculativeConfigError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse vLLM's JSON form (`{"method": "ngram", "num_speculative_tokens": 4, ...}`)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> SpeculativeConfig:
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise SpeculativeConfigError(f"unknown --speculative-config key(s) {unknown}; known: {sorted(_KEYS)}")
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
                    "draft_tensor_parallel_size"):
            value = raw.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise SpeculativeConfigError(f"{key} must be an integer, got {value!r}")
        for key in ("method", "model"):
            if raw.get(key) is not None and not isinstance(raw[key], str):
                raise SpeculativeConfigError(f"{key} must be a string, got {raw[key]!r}")
        method = raw.get("method")
        if method is None:
            # vLLM infers the method from `model`; without one, n-gram is the only candidate.
            method = "draft_model" if raw.get("model") else "ngram"
        if raw.get("num_speculative_tokens") is None:
            raise SpeculativeConfigError("num_speculative_tokens is required")
        if raw.get("draft_tensor_parallel_size", 1) != 1:
            raise SpeculativeConfigError("draft_tensor_parallel_size must be 1: the draft runs unsharded on rank 0")
        lookup_min, lookup_max = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
        elif lookup_min is None:
            lookup_min = lookup_max
        elif lookup_max is None:
            lookup_max = lookup_min
        return cls(method=method, num_speculative_tokens=raw["num_speculative_tokens"],
                   prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max, model=raw.get("model"),
                   disable_by_batch_size=raw.get("disable_by_batch_size"))

    def to_json(self) -> str:
        """The flag's value for a child process (`cbserve up`, tensor-parallel ranks need none)."""
        raw = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            raw.update(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
        else:
            raw["model"] = self.model
        if self.disable_by_batch_size is not None:
            raw["disable_by_batch_size"] = self.disable_by_batch_size
        return json.dumps(raw, separators=(",", ":"))


def speculative_config_arg(value: str) -> SpeculativeConfig:
    """argparse type for `--speculative-config`."""
    import argparse

    try:
        return SpeculativeConfig.from_json(value)
    except SpeculativeConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
