"""`--speculative-config JSON`: vLLM's flag and keys, parsed and checked at the boundary.

Torch-free (the CLI, `cbserve up` and the chart's tests read it). Methods:
- `ngram` (prompt lookup): `num_speculative_tokens`, `prompt_lookup_min`, `prompt_lookup_max`
  (vLLM's defaults: both 5 when both are omitted, one copies the other when only one is given);
- `draft_model`: `model` (a preset name or a local HF directory on the target's tokenizer),
  `num_speculative_tokens`;
- `eagle` (EAGLE-1): `model` (a head's directory in the layout vLLM loads: a Llama `config.json`,
  `fc` over [token embedding, target hidden state], Llama decoder layers; it shares the target's
  embedding and lm_head, `engine.spec_decode.eagle_head`), `num_speculative_tokens`;
- `eagle3` / `mtp` / `medusa` / `mlp_speculator` are refused by name (see `REFUSED_METHODS`).

Optional keys: `disable_by_batch_size` (vLLM's: no speculation from this many running requests
on; the measured off-switch in `engine.spec_decode.adaptive` applies below it too) and
`draft_tensor_parallel_size` (only 1: the draft runs unsharded on rank 0).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "eagle")
MODEL_METHODS = ("draft_model", "eagle")   # the methods whose proposer is a checkpoint (`model`)
REFUSED_METHODS = {
    "eagle3": "EAGLE-3 heads read three of the target's layers' hidden states and map a draft vocabulary "
              "(d2t), which this engine does not build (EAGLE-1 heads: method 'eagle')",
    "mtp": "MTP heads read the target's hidden states through the target's own extra layers, which this "
           "engine does not load",
    "medusa": "Medusa heads are not built (EAGLE-1 heads, method 'eagle', read the target's hidden states)",
    "mlp_speculator": "MLP speculators are not built (EAGLE-1 heads, method 'eagle', read the target's "
                      "hidden states)",
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
                f"speculative method {self.method!r} is not supported: {REFUSED_METHODS[self.method]}; "
                f"use one of {METHODS}")
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
                raise SpeculativeConfigError(f"model is for methods {MODEL_METHODS}, not 'ngram'")
        elif not self.model:
            what = "an EAGLE head's directory" if self.method == "eagle" else "a preset name or a model directory"
            raise SpeculativeConfigError(f"method {self.method!r} needs model ({what})")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise SpeculativeConfigError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    def check_tensor_parallel(self, size: int) -> None:
        """An EAGLE head reads the target's embedding and lm_head, which tensor parallelism splits
        across ranks while the proposer runs on rank 0 alone: refused (a draft model has its own)."""
        if self.method == "eagle" and size > 1:
            raise SpeculativeConfigError(
                f"--speculative-config method 'eagle' with --tensor-parallel-size {size} is not supported: the "
                "head shares the target's vocab-parallel embedding and lm_head and runs on rank 0 only; use "
                "--tensor-parallel-size 1 or method 'draft_model' / 'ngram'")

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
