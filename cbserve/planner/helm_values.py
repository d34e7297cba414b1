"""The Helm values file of a plan: pool sizes, engine knobs and HPA targets for `helm install -f`.

Only keys of `helm/values.yaml` are written (its schema allows no others), so the chart's defaults
hold for everything else:
- `model` (name, dtype, quantization) and `slo` as planned; `router.policy` of the configuration;
- pools: disaggregated, `prefill` and `decode` replicas x and y; colocated, `prefill.enabled:
  false` and the decode pool's K pods serve whole requests; each pool's engine knobs as profiled
  (`maxNumBatchedTokens`, `maxNumSeqs`, `blockSize`, `numBlocks`), `gpus: 0` on a CPU profile;
- HPAs: the simulated per-pod means at the operating point (`headroom` x capacity): running
  requests per decode pod (`targetRunningRequestsPerPod`), queued prefill tokens per prefill pod
  (`targetQueueTokensPerPod`), KV usage per decode pod (`targetKvCacheUsageRatio`, at most 0.8);
  minReplicas the planned pool, maxReplicas `max_scale` times it.
"""

from __future__ import annotations

import math

import yaml


def _positive(value: float) -> int:
    return max(1, math.ceil(value))


def values(*, fields: dict, profile, slo_ttft_ms: float, slo_tpot_ms: float, load: dict[str, dict],
           max_scale: float = 2.0, max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None) -> dict:
    """The values dict for configuration `fields` (`parse_config`); `load`: role -> mean pod load at
    the operating point (`SimCluster.mean_load`)."""
    e, model = profile.engine, profile.data["model"]
    cpu = profile.data["device"]["type"] == "cpu"
    engine = {"maxNumBatchedTokens": max_num_batched_tokens or e["max_num_batched_tokens"],
              "maxNumSeqs": max_num_seqs or e["max_num_seqs"], "blockSize": e["block_size"],
              "numBlocks": e["num_blocks"]}

    def pool(replicas: int, autoscaling: dict) -> dict:
        return {"replicas": replicas, "gpus": 0 if cpu else max(1, e.get("tensor_parallel_size", 1)),
                "engine": dict(engine),
                "autoscaling": {"enabled": True, "minReplicas": replicas,
                                "maxReplicas": max(replicas, math.ceil(replicas * max_scale)), **autoscaling}}

    out = {"model": {"name": profile.model_name, "dtype": model["dtype"], "quantization": model["quantization"] or ""},
           "slo": {"ttftMs": _positive(slo_ttft_ms), "tpotMs": _positive(slo_tpot_ms)},
           "router": {"policy": fields["policy"]}}
    colocated = fields.get("num_colocated", 0)
    decode_role = "colocated" if colocated else "decode"
    decode_load = load.get(decode_role, {})
    decode_targets = {"targetRunningRequestsPerPod": _positive(decode_load.get("running_requests", 1.0)),
                      "targetKvCacheUsageRatio": round(min(0.8, max(0.05, decode_load.get("kv_cache_usage", 0.8))), 2)}
    if colocated:
        out["prefill"] = {"enabled": False}
        out["decode"] = pool(colocated, decode_targets)
    else:
        queue = load.get("prefill", {}).get("prefill_queue_tokens", 0.0)
        # At least one chunk: a queue below one step's budget never delays a prompt by a step.
        out["prefill"] = {"enabled": True, **pool(fields["num_prefill"], {
            "targetQueueTokensPerPod": _positive(max(queue, engine["maxNumBatchedTokens"]))})}
        out["decode"] = pool(fields["num_decode"], decode_targets)
    return out


def render(values_dict: dict, header: list[str]) -> str:
    """YAML with `header` lines as comments on top (provenance: profile, workload, prediction)."""
    lines = [f"# {line}" for line in header]
    return "\n".join(lines) + "\n" + yaml.safe_dump(values_dict, sort_keys=False)
