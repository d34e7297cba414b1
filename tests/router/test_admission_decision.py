"""The admission decision over fake pod states: route where, refuse for the SLO, or wait for a pod
that is starting; and the same answers for the same load, run after run (issue 20).

Each row is the pods as the router sees them (load, health, silence, calibration, step model) and
the outcome of one routing attempt (`Dispatcher._try_route`, what admission retries): a (prefill,
decode) pair, or the NoRoute reason ("slo" -> 429 after the queue wait, "starting" -> wait for a
pod, "no_pods" -> 503 at once).
"""

from __future__ import annotations

import random

import pytest

from policy_pods import pod, request, tracker_of
from router.admission import AdmissionController
from router.dispatch import Dispatcher
from router.load import PodState
from router.metrics import RouterMetrics
from router.policy import NoRoute, PrefixIndex, build_policy
from router.policy.base import MaxScorePicker


def stepping(state: PodState, fixed: float = 0.008, per_seq: float = 0.0005, per_token: float = 2e-5) -> PodState:
    """`state` with a fitted step model: `fixed + per_seq·n + per_token·prefill tokens` seconds."""
    for i in range(64):
        seqs = 1 + i % 16
        prefill = 256 * (i % 4 == 0)
        state.step_model.add(seqs, 20 * seqs + prefill, prefill, fixed + per_seq * seqs + per_token * prefill)
    return state


def calibrated(state: PodState, factor: float) -> PodState:
    for _ in range(state.tpot_calibration.min_samples):
        state.tpot_calibration.observe(factor, 1.0)
        state.ttft_calibration.observe(factor, 1.0)
    return state


def handing_over(state: PodState, gap_seconds: float) -> PodState:
    """`state` having measured P→D hand-overs of `gap_seconds`."""
    for _ in range(state.pd_gap.min_samples):
        state.pd_gap.observe(gap_seconds)
    return state


def dispatcher(pods: list[PodState], seed: int = 0, local_prefill_fallback: bool = True) -> Dispatcher:
    prefix_index = PrefixIndex()
    policy = build_policy("goodput", prefix_index, local_prefill_fallback=local_prefill_fallback)
    for profile in policy.profiles.values():
        profile.picker = MaxScorePicker(random.Random(seed))
    return Dispatcher(tracker_of(pods), policy, AdmissionController("queue", 5.0, 64), prefix_index, RouterMetrics())


def outcome(d: Dispatcher, **kwargs) -> tuple[str | None, str] | str:
    decision = d._try_route(request(17, **kwargs))
    if isinstance(decision, NoRoute):
        return decision.reason
    return (decision.prefill.address if decision.prefill else None, decision.decode.address)


P, D = "prefill", "decode"
# (name, pods, request kwargs, expected)
CASES = [
    ("a frozen decode pod (silent, its last report idle) gets nothing while a healthy one can",
     lambda: [stepping(pod("p", P)), stepping(pod("d0", D, silent=True)), stepping(pod("d1", D, running=3))],
     {}, ("p", "d1")),
    ("a decode pod taken out after a failed call does not count",
     lambda: [stepping(pod("p", P)), stepping(pod("d0", D, healthy=False)), stepping(pod("d1", D, running=3))],
     {}, ("p", "d1")),
    ("a stalled decode pod (NOT_SERVING) does not count",
     lambda: [stepping(pod("p", P)), stepping(pod("d0", D, serving=False)), stepping(pod("d1", D, running=3))],
     {}, ("p", "d1")),
    ("the only decode pod, silent (its loop starved), still serves",
     lambda: [stepping(pod("p", P)), stepping(pod("d0", D, silent=True))], {}, ("p", "d0")),
    ("a failed pod's calibration is its own: the healthy pod is priced by its own",
     lambda: [stepping(pod("p", P)), calibrated(stepping(pod("d0", D, healthy=False)), 3.0),
              calibrated(stepping(pod("d1", D, running=12)), 1.0)], {}, ("p", "d1")),
    ("a burst of short prompts queued on the prefill pod shares a step: admitted, whatever its tokens/s",
     lambda: [stepping(pod("p", P, queued_tokens=16 * 17, waiting=16, rate=178, budget=512)),
              stepping(pod("d", D, running=2))], {}, ("p", "d")),
    ("a prefill queue of 40 full steps misses a 500 ms TTFT",
     lambda: [stepping(pod("p", P, queued_tokens=20_000, waiting=40, budget=512), fixed=0.04),
              stepping(pod("d", D))], {}, "slo"),
    ("the same queue meets a 5 s TTFT",
     lambda: [stepping(pod("p", P, queued_tokens=20_000, waiting=40, budget=512), fixed=0.04),
              stepping(pod("d", D))], {"slo_ttft": 5.0}, ("p", "d")),
    ("no healthy decode pod meets the TPOT SLO",
     lambda: [stepping(pod("p", P)), stepping(pod("d0", D, healthy=False)),
              stepping(pod("d1", D, running=30), fixed=0.04, per_seq=0.002)], {}, "slo"),
    ("an 8-token answer is mostly hand-over: a 60 ms gap and 10 ms steps meet a 50 ms TPOT",
     lambda: [stepping(pod("p", P)), handing_over(stepping(pod("d", D, running=4)), 0.06)],
     {"max_tokens": 8}, ("p", "d")),
    ("a 2-token answer is all hand-over: 60 ms misses it",
     lambda: [stepping(pod("p", P)), handing_over(stepping(pod("d", D, running=4)), 0.06)],
     {"max_tokens": 2}, "slo"),
    ("the only decode pod is starting (discovered, not answering yet): wait for it",
     lambda: [stepping(pod("p", P)), pod("d0", D, healthy=False)], {}, "starting"),
    ("every decode pod is draining: nothing to wait for",
     lambda: [stepping(pod("p", P)), pod("d0", D, draining=True)], {}, "no_pods"),
    ("the prefill pod is starting: decode pods prefill locally meanwhile",
     lambda: [pod("p", P, healthy=False), stepping(pod("d", D))], {}, (None, "d")),
    ("the prefill pod is starting, no local prefill: wait for it",
     lambda: [pod("p", P, healthy=False), stepping(pod("d", D))], {"fallback": False}, "starting"),
    ("the starting pod already failed this request: nothing to wait for",
     lambda: [stepping(pod("p", P)), pod("d0", D, healthy=False)], {"exclude": frozenset({"d0"})}, "no_pods"),
]


@pytest.mark.parametrize("name,pods,kwargs,expected", CASES, ids=[c[0] for c in CASES])
def test_admission_decision(name, pods, kwargs, expected):
    fallback = kwargs.pop("fallback", True)
    assert outcome(dispatcher(pods(), local_prefill_fallback=fallback), **kwargs) == expected


def _burst(pods: list[PodState], seed: int, size: int = 16) -> list:
    """A burst of `size` requests routed one after another, each reserving its pods (no report
    arrives within a burst)."""
    d = dispatcher(pods, seed)
    return [outcome(d) for _ in range(size)]


def _healthy_pair() -> list[PodState]:
    return [stepping(pod("p", P, budget=512)), stepping(pod("d0", D)), stepping(pod("d1", D))]


def _one_frozen() -> list[PodState]:
    return [stepping(pod("p", P, budget=512)), stepping(pod("d0", D, silent=True)), stepping(pod("d1", D))]


def _one_pod() -> list[PodState]:
    return [stepping(pod("p", P, budget=512)), stepping(pod("d1", D))]


def test_the_same_load_gets_the_same_answers_whatever_the_tie_breaks():
    for pods in (_healthy_pair, _one_frozen, _one_pod):
        admitted = {sum(isinstance(o, tuple) for o in _burst(pods(), seed)) for seed in range(20)}
        assert len(admitted) == 1, (pods.__name__, admitted)


def test_a_frozen_decode_pod_costs_no_admissions_a_single_healthy_pod_can_carry():
    alone = _burst(_one_pod(), 0)
    frozen = _burst(_one_frozen(), 0)
    assert sum(isinstance(o, tuple) for o in frozen) >= sum(isinstance(o, tuple) for o in alone)
    assert all(o[1] == "d1" for o in frozen if isinstance(o, tuple))   # none to the frozen pod
