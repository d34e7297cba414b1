"""The profile file `cbserve profile` writes and `cbserve plan` reads (JSON, versioned).

    {"format": "cbserve-profile", "version": 1, "created": ..., "cbserve_commit": ...,
     "device": {...}, "model": {..., num_layers, layer_windows},
     "engine": {...flags, num_blocks, kv_bytes_per_token, kv_cache_groups, kv_group_windows, speculative},
     "timer": "thread_time" | "wall",
     "cost_model": {"features": [...], "coefficients": [...]},
     "fit": {"mape", "max_error", "points"}, "held_out": {"mape", "max_error", "points", "by_kind"},
     "grid": [measurements], "held_out_points": [measurements],
     "serving": {"contention", "prefill_contention", "colocated_contention", "alone_contention",
                 "alone_prefill_contention",
                 "colocated_split", "decode_row_s", "alone_rows", "step_gap_s", "http_in_s", "rpc_s", "token_out_s", "kv_message_s", "kv_bytes_per_s",
                 "jitter_sigma", "cores", "cpu_per_token_s", "colocated_cpu_per_token_s",
                 "serving_cores", "colocated_serving_cores",
                 "in_situ": {...what was measured}} | null,
     "seconds": {"grid", "in_situ"}}

`model.layer_windows` (each layer's sliding window, 0: full; [] when none has one) and
`model.num_layers` let the plan's pods run the engine's KV groups for a mixed local/global model
(Gemma 3, gpt-oss); `engine.kv_group_windows` says which groups the profiled engine's `num_blocks`
pages were of. A profile without them (older) plans with one group.

`serving` is null for a profile made with `--no-in-situ` (the engine alone; the planner then
assumes no serving overhead and says so). A profile describes one device, one model and one set of
engine flags: `cbserve plan` refuses to reuse it for another model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from cbserve.planner.cost_model import StepCostModel
from cbserve.planner.cpu_share import CpuShareCosts
from cbserve.planner.sim_cluster import PodShape, ServingCosts
from cbserve.planner.sim_pod import PodCosts, PodKV
from engine.config import KV_CACHE_GROUPS, SchedulerConfig
from engine.kv_groups.spec import cache_groups

FORMAT = "cbserve-profile"
VERSION = 1
MAX_HELD_OUT_ERROR = 0.05       # `cbserve profile` refuses a profile above this held-out MAPE


class ProfileError(ValueError):
    """A profile file that cannot be used (unreadable, another format or version, incomplete)."""


@dataclass(frozen=True)
class ServingProfile:
    """What serving adds to the engine's steps, measured in situ (`in_situ.py`)."""

    contention: float = 1.0           # serving's wall seconds per profiled step second: decode pods
    prefill_contention: float = 1.0   # ... prefill pods
    colocated_contention: float | None = None   # ... colocated pods (None: the mean of the two)
    alone_contention: float | None = None       # ... the one pod of a one-pod cluster (None: its role's)
    alone_prefill_contention: float | None = None   # ... its steps' prefill part (None: the one factor)
    colocated_split: bool = False     # colocated steps: decode part at `contention`, prefill at `prefill_contention`
    decode_row_s: float = 0.0         # a decode row's cost beyond `contention` x its profiled share: decode pods, split colocated
    alone_rows: bool = False          # a lone pod pays `decode_row_s` too, its factors fitted with it (older profiles: no)
    step_gap_s: float = 0.0
    http_in_s: float = 0.0
    rpc_s: float = 0.0
    token_out_s: float = 0.0
    kv_message_s: float = 0.0
    kv_bytes_per_s: float = float("inf")
    jitter_sigma: float = 0.0         # the machine's slow stretches (`sim_pod.Jitter`)
    jitter_period_s: float = 1.0
    cores: float = 0.0                # the cores pods, router and client share (`cpu_share`; 0: none)
    cpu_per_token_s: float = 0.0      # the serving path's CPU per streamed token, on those cores
    colocated_cpu_per_token_s: float | None = None  # ... in a colocated cluster (None: the same)
    serving_cores: float = 0.0        # ... and what it uses whatever it streams (cores; older profiles: 0)
    colocated_serving_cores: float | None = None    # ... in a colocated cluster (None: the same)
    in_situ: dict = field(default_factory=dict)     # the measurements behind these numbers

    def contention_of(self, role: str) -> float:
        if role == "decode":
            return self.contention
        if role == "prefill":
            return self.prefill_contention
        return (self.contention + self.prefill_contention) / 2 if self.colocated_contention is None \
            else self.colocated_contention

    def contention_alone(self) -> float:
        """A one-pod cluster's (colocated-1): no other engine steps beside it (measured in situ)."""
        return self.contention_of("colocated") if self.alone_contention is None else self.alone_contention

    def costs(self) -> ServingCosts:
        return ServingCosts(self.http_in_s, self.rpc_s, self.token_out_s, self.kv_message_s, self.kv_bytes_per_s,
                            CpuShareCosts(self.cores, self.cpu_per_token_s, self.colocated_cpu_per_token_s,
                                          serving_cores=self.serving_cores,
                                          colocated_serving_cores=self.colocated_serving_cores))

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in ("contention", "prefill_contention", "colocated_contention",
                                             "alone_contention", "alone_prefill_contention",
                                             "colocated_split", "decode_row_s", "alone_rows", "step_gap_s",
                                             "http_in_s", "rpc_s", "token_out_s", "kv_message_s")}
        out["kv_bytes_per_s"] = None if self.kv_bytes_per_s == float("inf") else self.kv_bytes_per_s
        return out | {"jitter_sigma": self.jitter_sigma, "jitter_period_s": self.jitter_period_s,
                      "cores": self.cores, "cpu_per_token_s": self.cpu_per_token_s,
                      "colocated_cpu_per_token_s": self.colocated_cpu_per_token_s,
                      "serving_cores": self.serving_cores, "colocated_serving_cores": self.colocated_serving_cores,
                      "in_situ": self.in_situ}

    @classmethod
    def from_json(cls, value: dict) -> ServingProfile:
        rate = value.get("kv_bytes_per_s")
        optional = lambda k: None if value.get(k) is None else float(value[k])  # noqa: E731
        return cls(contention=float(value["contention"]), prefill_contention=float(value["prefill_contention"]),
                   colocated_contention=optional("colocated_contention"),
                   alone_contention=optional("alone_contention"),
                   alone_prefill_contention=optional("alone_prefill_contention"),
                   colocated_split=bool(value.get("colocated_split", False)),
                   decode_row_s=float(value.get("decode_row_s", 0.0)),
                   alone_rows=bool(value.get("alone_rows", False)),
                   step_gap_s=float(value["step_gap_s"]),
                   http_in_s=float(value["http_in_s"]), rpc_s=float(value["rpc_s"]),
                   token_out_s=float(value["token_out_s"]), kv_message_s=float(value["kv_message_s"]),
                   kv_bytes_per_s=float("inf") if rate is None else float(rate),
                   jitter_sigma=float(value.get("jitter_sigma", 0.0)),
                   jitter_period_s=float(value.get("jitter_period_s", 1.0)), cores=float(value.get("cores", 0.0)),
                   cpu_per_token_s=float(value.get("cpu_per_token_s", 0.0)),
                   colocated_cpu_per_token_s=optional("colocated_cpu_per_token_s"),
                   serving_cores=float(value.get("serving_cores", 0.0)),
                   colocated_serving_cores=optional("colocated_serving_cores"),
                   in_situ=dict(value.get("in_situ", {})))


@dataclass(frozen=True)
class Profile:
    """A parsed profile; `data` is the whole JSON document."""

    data: dict
    cost_model: StepCostModel
    serving: ServingProfile | None

    @property
    def model_name(self) -> str:
        return self.data["model"]["name"]

    @property
    def engine(self) -> dict:
        return self.data["engine"]

    @property
    def held_out_error(self) -> float:
        return float(self.data["held_out"]["mape"])

    def shape(self, max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
              kv_cache_groups: str | None = None) -> PodShape:
        """The pods' engine as profiled, with the scheduler knobs (and `--kv-cache-groups`) optionally changed."""
        e = self.engine
        scheduler = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens or e["max_num_batched_tokens"],
                                    max_num_seqs=max_num_seqs or e["max_num_seqs"], max_model_len=e["max_model_len"])
        return PodShape(scheduler, int(e["num_blocks"]), int(e["block_size"]), int(e["kv_bytes_per_token"]),
                        self.pod_kv(kv_cache_groups))

    def pod_kv(self, kv_cache_groups: str | None = None) -> PodKV:
        """What the pods' KV groups follow (`sim_pod.PodKV`): one group for a profile without the
        model's layer windows."""
        m, e = self.data["model"], self.engine
        if "num_layers" not in m:
            return PodKV()
        layers, windows = int(m["num_layers"]), tuple(m.get("layer_windows") or ())
        profiled = cache_groups(windows, layers, tuple(e.get("kv_group_windows") or ()))
        return PodKV(layers, windows, kv_cache_groups or e.get("kv_cache_groups", "auto"),
                     bool(e.get("speculative", False)), profiled.slots)

    def pod_costs(self, step_scale: float = 1.0) -> dict[str, PodCosts]:
        """Each role's step costs, with the step time scaled by `step_scale` (sensitivity runs)."""
        s = self.serving or ServingProfile()
        row_s = s.decode_row_s * step_scale     # a decode row's host work, whatever the pod's role
        costs = {role: PodCosts(self.cost_model, s.contention_of(role) * step_scale, s.step_gap_s)
                 for role in ("prefill", "colocated")}
        costs["decode"] = PodCosts(self.cost_model, s.contention * step_scale, s.step_gap_s, row_s=row_s)
        if s.colocated_split:       # a colocated step's parts at the disaggregated roles' factors
            costs["colocated"] = PodCosts(self.cost_model, s.contention * step_scale, s.step_gap_s,
                                          s.prefill_contention * step_scale, row_s)
        # A lone pod pays it where its factors were fitted with it (`in_situ._fit_alone` says why).
        alone_prefill = None if s.alone_prefill_contention is None else s.alone_prefill_contention * step_scale
        return costs | {"alone": PodCosts(self.cost_model, s.contention_alone() * step_scale, s.step_gap_s,
                                          alone_prefill, row_s if s.alone_rows else 0.0)}

    def serving_costs(self, overhead_scale: float = 1.0) -> ServingCosts:
        c = (self.serving or ServingProfile()).costs()
        return ServingCosts(c.http_in_s * overhead_scale, c.rpc_s * overhead_scale, c.token_out_s * overhead_scale,
                            c.kv_message_s * overhead_scale, c.kv_bytes_per_s, c.cpu)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.data, indent=1) + "\n")


def build_profile(data: dict, cost_model: StepCostModel, serving: ServingProfile | None) -> Profile:
    data = dict(data, format=FORMAT, version=VERSION, cost_model=cost_model.to_json(),
                serving=None if serving is None else serving.to_json())
    return Profile(data, cost_model, serving)


def with_serving(profile: Profile, serving: ServingProfile) -> Profile:
    return build_profile(profile.data, profile.cost_model, serving)


def load_profile(path: str | Path) -> Profile:
    """The profile in `path`; ProfileError says what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ProfileError(f"{path}: cannot read the profile: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not a profile (invalid JSON: {e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f"{path}: not a cbserve profile (no \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise ProfileError(f"{path}: profile version {data.get('version')}, this cbserve reads version {VERSION}: "
                           "re-run `cbserve profile`")
    try:
        for key in ("model", "engine", "held_out", "device"):
            if not isinstance(data.get(key), dict):
                raise ProfileError(f"{path}: the profile has no {key!r} section")
        for key in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "num_blocks", "block_size",
                    "kv_bytes_per_token"):
            if not isinstance(data["engine"].get(key), int):
                raise ProfileError(f"{path}: engine.{key} is missing or not an integer")
        _check_kv_groups(path, data["model"], data["engine"])
        cost = StepCostModel.from_json(data["cost_model"])
        serving = None if data.get("serving") is None else ServingProfile.from_json(data["serving"])
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ProfileError):
            raise
        raise ProfileError(f"{path}: incomplete profile: {e}") from None
    return Profile(data, cost, serving)


def _check_kv_groups(path, model: dict, engine: dict) -> None:
    """The KV-group fields, where present (older profiles have none: one group)."""
    if "num_layers" not in model:
        return
    layers, windows = model["num_layers"], model.get("layer_windows") or []
    if not isinstance(layers, int) or layers < 1:
        raise ProfileError(f"{path}: model.num_layers must be a positive integer, got {layers!r}")
    if windows and (len(windows) != layers or not all(isinstance(w, int) and w >= 0 for w in windows)):
        raise ProfileError(f"{path}: model.layer_windows must give each of the {layers} layers a window >= 0, "
                           f"got {windows!r}")
    if engine.get("kv_cache_groups", "auto") not in KV_CACHE_GROUPS:
        raise ProfileError(f"{path}: engine.kv_cache_groups must be one of {KV_CACHE_GROUPS}, "
                           f"got {engine['kv_cache_groups']!r}")
    try:
        cache_groups(tuple(windows), layers, tuple(engine.get("kv_group_windows") or ()))
    except ValueError as e:
        raise ProfileError(f"{path}: engine.{e}") from None
