"""LoRA routing over fake pods: the affinity scorer's table (resident > free slot > queued > full),
the dispatcher's rule that an adapter's requests go only to pods serving it (a decode pod prefills
locally when no prefill pod does), and the policies preferring the pod that has it resident."""

from __future__ import annotations

import pytest

from router.lora.state import prefix_root, served_adapters
from router.policy import NoRoute, PrefixIndex, build_policy
from router.policy.lora_affinity import FREE_SLOT, FULL, QUEUED, RESIDENT, LoRAAffinityScorer
from router.dispatch import Dispatcher
from tests.router.policy_pods import pod, request


def with_adapters(state, max_loras: int, *adapters: tuple):
    """adapters: (name, resident, running, waiting[, registered])"""
    state.report.max_loras = max_loras
    for name, resident, running, waiting, *registered in adapters:
        state.report.lora_adapters.add(name=name, identity=f"id-{name}", registered=registered[0] if registered else True,
                                       resident=resident, num_running=running, num_waiting=waiting)
    return state


# pod's (max_loras, adapters) -> score for a request of adapter "a"
TABLE = [
    ("resident, running", (2, [("a", True, 3, 0)]), RESIDENT),
    ("resident, idle", (1, [("a", True, 0, 0), ("b", False, 0, 0)]), RESIDENT),
    ("not resident, a slot free", (2, [("a", False, 0, 0), ("b", True, 2, 0)]), FREE_SLOT),
    ("idle resident others are evictable", (2, [("a", False, 0, 0), ("b", True, 0, 0), ("c", True, 0, 0)]),
     FREE_SLOT),
    ("full, a queued there", (2, [("a", False, 0, 4), ("b", True, 1, 0), ("c", True, 1, 0)]), QUEUED),
    ("full of other adapters", (1, [("a", False, 0, 0), ("b", True, 5, 0)]), FULL),
]


@pytest.mark.parametrize("case, setup, expected", TABLE, ids=[c for c, _, _ in TABLE])
def test_affinity_table(case, setup, expected):
    max_loras, adapters = setup
    p = with_adapters(pod("p:1", "decode"), max_loras, *adapters)
    req = request()
    scorer = LoRAAffinityScorer()
    assert scorer.score(req.__class__(**{**req.__dict__, "lora_name": "a"}), [p]) == {"p:1": expected}
    assert scorer.score(req, [p]) == {"p:1": 1.0}            # the base model: neutral


class _Tracker:
    def __init__(self, pods):
        self.pods = {p.address: p for p in pods}

    def routable(self, role):
        return [p for p in self.pods.values() if p.role == role and p.routable]


def _dispatcher(pods, policy="goodput"):
    return Dispatcher(_Tracker(pods), build_policy(policy, PrefixIndex()), admission=None,
                      prefix_index=PrefixIndex(), metrics=None)


def _lora_request(name):
    base = request(num_prompt_tokens=50)
    return base.__class__(**{**base.__dict__, "lora_name": name})


def test_only_pods_serving_the_adapter_get_its_requests():
    pods = [with_adapters(pod("p1:1", "prefill"), 2, ("a", True, 0, 0)), pod("p2:1", "prefill"),
            with_adapters(pod("d1:1", "decode"), 2, ("a", False, 0, 0)),
            with_adapters(pod("d2:1", "decode"), 2, ("a", False, 0, 0, False)),   # unloaded there
            pod("d3:1", "decode")]
    dispatcher = _dispatcher(pods)
    for _ in range(20):
        decision = dispatcher.policy.route(_lora_request("a"), dispatcher.pods_by_role("a"))
        assert (decision.prefill.address, decision.decode.address) == ("p1:1", "d1:1")
    assert isinstance(dispatcher.policy.route(_lora_request("zzz"), dispatcher.pods_by_role("zzz")), NoRoute)
    assert served_adapters(pods) == ["a"]


def test_no_prefill_pod_with_the_adapter_means_local_prefill():
    pods = [pod("p1:1", "prefill"), with_adapters(pod("d1:1", "decode"), 1, ("a", False, 0, 0))]
    dispatcher = _dispatcher(pods)
    decision = dispatcher.policy.route(_lora_request("a"), dispatcher.pods_by_role("a"))
    assert decision.prefill is None and decision.decode.address == "d1:1"


@pytest.mark.parametrize("policy", ["goodput", "least_loaded"])
def test_equal_pods_resident_one_wins(policy):
    """Four idle-equal decode pods with one slot each: d3 has "a" resident, the others are busy with "b"."""
    pods = [with_adapters(pod("p1:1", "prefill"), 4, ("a", True, 0, 0))]
    pods += [with_adapters(pod(f"d{i}:1", "decode"), 1, ("a", i == 3, 0, 0), ("b", i != 3, int(i != 3), 0))
             for i in range(1, 5)]
    dispatcher = _dispatcher(pods, policy)
    picks = {dispatcher.policy.route(_lora_request("a"), dispatcher.pods_by_role("a")).decode.address
             for _ in range(30)}
    assert picks == {"d3:1"}


def test_prefix_roots_keep_adapters_apart():
    assert prefix_root(None) == prefix_root("") == 0
    assert len({prefix_root(n) for n in ("a", "b", "base")}) == 3
    assert prefix_root("a") == prefix_root("a")
