"""The three policies end to end over fake pods: which (prefill, decode) pair each one picks."""

from __future__ import annotations

import pytest

from policy_pods import pod, request
from router.policy import NoRoute, PrefixIndex, RoutingDecision, build_policy, block_hashes


def _pods(prefill, decode, colocated=()):
    return {"prefill": list(prefill), "decode": list(decode), "colocated": list(colocated)}


# (name, policy, pods_by_role, request kwargs, expected (prefill, decode) or NoRoute reason)
CASES = [
    ("least_loaded: fewest queued tokens and requests", "least_loaded",
     _pods([pod("p1", queued_tokens=900), pod("p2", queued_tokens=10)],
           [pod("d1", "decode", running=9), pod("d2", "decode", running=1)]), {}, ("p2", "d2")),
    ("least_loaded: never refuses for latency", "least_loaded",
     _pods([pod("p1", queued_tokens=10**6)], [pod("d1", "decode", step=5.0)]), {}, ("p1", "d1")),
    ("goodput: most headroom on both sides", "goodput",
     _pods([pod("p1", queued_tokens=300), pod("p2", queued_tokens=100)],
           [pod("d1", "decode", step=0.01), pod("d2", "decode", step=0.03)]), {}, ("p2", "d1")),
    ("goodput: prefers a slower pod that meets the SLO over none", "goodput",
     _pods([pod("p1", queued_tokens=2000), pod("p2", queued_tokens=350)], [pod("d1", "decode")]), {},
     ("p2", "d1")),
    ("goodput: nothing meets the TTFT SLO", "goodput",
     _pods([pod("p1", queued_tokens=2000)], [pod("d1", "decode")]), {}, "slo"),
    ("goodput: nothing meets the TPOT SLO", "goodput",
     _pods([pod("p1")], [pod("d1", "decode", step=0.2, running=8)]), {}, "slo"),
    ("goodput: an idle pod takes even a request it will be slow for", "goodput",
     _pods([pod("p1", rate=50)], [pod("d1", "decode", step=0.2)]), {}, ("p1", "d1")),
    ("goodput: looser per-request SLO admits", "goodput",
     _pods([pod("p1", queued_tokens=2000)], [pod("d1", "decode")]), {"slo_ttft": 5.0}, ("p1", "d1")),
    ("goodput: colocated pods", "goodput",
     _pods([], [], [pod("c1", "colocated", step=0.045), pod("c2", "colocated", step=0.01)]), {}, (None, "c2")),
    ("no decode pod at all", "goodput", _pods([pod("p1")], []), {}, "no_pods"),
    ("retry excludes the failed decode pod", "round_robin",
     _pods([pod("p1")], [pod("d1", "decode"), pod("d2", "decode")]), {"exclude": frozenset({"d1"})},
     ("p1", "d2")),
]


@pytest.mark.parametrize("name,policy,pods,kwargs,expected", CASES, ids=[c[0] for c in CASES])
def test_policy_routes(name, policy, pods, kwargs, expected):
    decision = build_policy(policy, PrefixIndex()).route(request(100, **kwargs), pods)
    if isinstance(expected, str):
        assert isinstance(decision, NoRoute) and decision.reason == expected
        assert decision.retry_after_seconds >= 1.0
    else:
        assert isinstance(decision, RoutingDecision)
        prefill = decision.prefill.address if decision.prefill else None
        assert (prefill, decision.decode.address) == expected


def test_round_robin_alternates_pairs():
    policy = build_policy("round_robin", PrefixIndex())
    pods = _pods([pod("p1"), pod("p2")], [pod("d1", "decode"), pod("d2", "decode")])
    picks = [policy.route(request(), pods) for _ in range(4)]
    assert [(d.prefill.address, d.decode.address) for d in picks] == [
        ("p1", "d1"), ("p2", "d2"), ("p1", "d1"), ("p2", "d2")]


def test_goodput_follows_the_prefix_to_the_warm_pod():
    index = PrefixIndex()
    policy = build_policy("goodput", index)
    hashes = block_hashes(list(range(320)), 16)
    index.record(hashes, "p2")
    # Equal queues: without the prefix both would tie; p2 computes 1 token instead of 320.
    pods = _pods([pod("p1", queued_tokens=50), pod("p2", queued_tokens=50)], [pod("d1", "decode")])
    for _ in range(10):
        assert policy.route(request(320, hashes=hashes), pods).prefill.address == "p2"


def test_goodput_retry_after_is_the_predicted_excess():
    policy = build_policy("goodput", PrefixIndex())
    decision = policy.route(request(100), _pods([pod("p1", queued_tokens=4900)], [pod("d1", "decode")]))
    assert isinstance(decision, NoRoute)
    assert decision.retry_after_seconds == pytest.approx(5.0 - 0.5)   # (4900 + 100) / 1000 - SLO
