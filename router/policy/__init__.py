"""Routing policies: `build_policy(name, ...)` for round_robin, least_loaded and goodput."""

from __future__ import annotations

from router.policy.base import NoRoute, Policy, Profile, RoutingDecision, RoutingRequest
from router.policy.goodput import GoodputPolicy, LatencyPredictor
from router.policy.least_loaded import least_loaded_policy
from router.policy.lora_affinity import LoRAAffinityScorer
from router.policy.prefix_affinity import PrefixIndex, block_hashes
from router.policy.round_robin import round_robin_policy

LORA_AFFINITY_WEIGHT = 0.5
__all__ = ["NoRoute", "Policy", "Profile", "RoutingDecision", "RoutingRequest", "PrefixIndex",
           "block_hashes", "build_policy"]


def build_policy(name: str, prefix_index: PrefixIndex, default_prefill_tokens_per_second: float = 20000.0,
                 local_prefill_fallback: bool = True) -> Policy:
    """The named policy; `local_prefill_fallback`: see `Policy.local_prefill_fallback`."""
    if name == "round_robin":
        policy = round_robin_policy()
    elif name == "least_loaded":
        policy = least_loaded_policy()
    elif name == "goodput":
        policy = GoodputPolicy(LatencyPredictor(prefix_index, default_prefill_tokens_per_second))
    else:
        raise ValueError(f"unknown policy {name!r}")
    if name != "round_robin":   # a pod that has the request's LoRA adapter in a slot, where load allows
        for profile in policy.profiles.values():
            profile.scorers.append((LoRAAffinityScorer(), LORA_AFFINITY_WEIGHT))
    policy.local_prefill_fallback = local_prefill_fallback
    return policy
