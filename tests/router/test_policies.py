"""The three policies end to end over fake pods: which (prefill, decode) pair each one picks,
and the goodput TPOT calibration fed by the router's own measurements."""

from __future__ import annotations

import asyncio

import pytest

from wire import cbserve_pb2 as pb
from fake_pods import Script
from policy_pods import pod, request
from router_harness import running_router
from router.dispatch import with_ttft_budget_left
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
    ("no prefill pod: the least loaded decode pod prefills locally", "goodput",
     _pods([], [pod("d1", "decode", step=0.03), pod("d2", "decode", step=0.01)]), {}, (None, "d2")),
    ("every prefill pod failed this request: local prefill", "round_robin",
     _pods([pod("p1")], [pod("d1", "decode")]), {"exclude": frozenset({"p1"})}, (None, "d1")),
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


@pytest.mark.parametrize("policy", ["goodput", "round_robin", "least_loaded"])
def test_no_local_prefill_fallback_means_no_route_without_a_prefill_pod(policy):
    decision = build_policy(policy, PrefixIndex(), local_prefill_fallback=False).route(
        request(100), _pods([], [pod("d1", "decode")]))
    assert isinstance(decision, NoRoute) and decision.reason == "no_pods"


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


# (name, seconds waited in the router's queue, prefill pod's rate in tokens/s, expected)
WAITED_CASES = [
    ("fits in what is left of its budget", 0.3, 1000.0, ("p1", "d1")),          # 0.1 s of 0.2 left
    ("the wait made it late: refused even by the idle pod", 0.45, 1000.0, "slo"),  # 0.1 s of 0.05 left
    ("its own size makes it miss: the idle pod takes it, as unwaited", 0.45, 50.0, ("p1", "d1")),  # 2 s of 0.5
]


@pytest.mark.parametrize("name,waited,rate,expected", WAITED_CASES, ids=[c[0] for c in WAITED_CASES])
def test_goodput_idle_pod_and_a_request_that_waited(name, waited, rate, expected):
    # A 100-token prompt on an idle prefill pod takes 100 / rate seconds; the request's TTFT SLO is
    # 0.5 s, less its wait. The wait, not the pod, is why it would miss: no pod is worth its slot.
    routing = with_ttft_budget_left(request(100), waited)
    assert routing.waited_seconds == waited and routing.slo_ttft_seconds == pytest.approx(0.5 - waited)
    decision = build_policy("goodput", PrefixIndex()).route(
        routing, _pods([pod("p1", rate=rate)], [pod("d1", "decode")]))
    if isinstance(expected, str):
        assert isinstance(decision, NoRoute) and decision.reason == expected
    else:
        assert (decision.prefill.address, decision.decode.address) == expected


def test_goodput_retry_after_is_the_predicted_excess():
    policy = build_policy("goodput", PrefixIndex())
    decision = policy.route(request(100), _pods([pod("p1", queued_tokens=4900)], [pod("d1", "decode")]))
    assert isinstance(decision, NoRoute)
    assert decision.retry_after_seconds == pytest.approx(5.0 - 0.5)   # (4900 + 100) / 1000 - SLO


def _fitted_decode(address: str, running: int, factor: float = 1.0):
    """A decode pod whose step model is fitted (5 ms + 1 ms per sequence) and calibrated to `factor`."""
    d = pod(address, "decode", running=running)
    for seqs in range(1, 40):
        d.step_model.add(seqs, 100 * seqs, 0, 0.005 + 0.001 * seqs)
    for _ in range(d.tpot_calibration.min_samples):
        d.tpot_calibration.observe(0.01 * factor, 0.01)
    return d


# (name, decode pods as (address, running, calibration factor), expected decode pod or NoRoute reason)
CALIBRATED_CASES = [
    ("equal calibration: the smaller batch", [("d1", 10, 1.0), ("d2", 2, 1.0)], "d2"),
    ("the smaller batch whose clients see 3x the model loses", [("d1", 10, 1.0), ("d2", 2, 3.0)], "d1"),
    ("calibrated past the SLO everywhere: refused", [("d1", 20, 2.0), ("d2", 25, 1.8)], "slo"),
]


@pytest.mark.parametrize("name,decode,expected", CALIBRATED_CASES, ids=[c[0] for c in CALIBRATED_CASES])
def test_goodput_ranks_decode_pods_by_calibrated_tpot(name, decode, expected):
    policy = build_policy("goodput", PrefixIndex())
    pods = _pods([pod("p1")], [_fitted_decode(*d) for d in decode])
    decision = policy.route(request(100), pods)
    if expected == "slo":
        assert isinstance(decision, NoRoute) and decision.reason == "slo"
        return
    assert decision.decode.address == expected
    # The decision carries the uncalibrated prediction, for the dispatcher to calibrate with.
    running = dict((a, r) for a, r, _ in decode)[expected]
    assert decision.predicted_tpot_seconds == pytest.approx(0.005 + 0.001 * (running + 1), abs=1e-3)


def test_goodput_decision_has_no_prediction_before_the_model_is_fitted():
    decision = build_policy("goodput", PrefixIndex()).route(request(100), _pods([pod("p1")], [pod("d1", "decode")]))
    assert decision.predicted_tpot_seconds is None


@pytest.mark.anyio
async def test_router_calibrates_a_decode_pod_from_the_tpot_it_measures(tokenizer):
    # The pod reports 5 ms steps, but its tokens arrive every 12 ms (gaps the step does not show),
    # the first after P's token too (the P->D hand-over, which the router learns apart: its median).
    # The factor is observed / predicted TPOT, the prediction spreading the learnt hand-over over
    # the answer's 4 gaps (`predict.client_tpot`).
    samples = [pb.StepSample(num_seqs=n, num_context_tokens=100 * n, seconds=0.005) for n in range(1, 11)]
    decode = Script(token_delay=0.012, load=pb.LoadReport(step_samples=samples, step_seconds_ewma=0.005))
    async with running_router(tokenizer, prefill=[Script()], decode=[decode], policy="goodput",
                              slo_tpot_ms=1000.0) as h:
        client = h.http()
        state = h.state.dispatcher.tracker.pods[h.decode[0].address]
        assert state.step_model.fitted and state.tpot_calibration.factor == 1.0
        for batch in range(3):
            responses = await asyncio.gather(*(client.post("/v1/completions", json={"prompt": f"q{batch}{i}",
                                                                                 "max_tokens": 5})
                                               for i in range(8)))
            assert all(r.status_code == 200 for r in responses)
        assert state.tpot_calibration.num_samples == 24
        # The hand-over is at least one token delay (more on a loaded machine); at least half the
        # requests had one that long and every later gap >= 12 ms, so the 95% quantile of the
        # ratios is at least (gap + 3 x 12) / (gap + 3 x 5).
        gap = state.pd_gap.value
        assert gap >= 0.012 * 0.9
        assert (gap + 3 * 0.012) / (gap + 3 * 0.005) * 0.9 <= state.tpot_calibration.factor <= 3.0
        # Every first token also calibrated the prefill pod's TTFT (routing -> first token).
        prefill = h.state.dispatcher.tracker.pods[h.prefill[0].address]
        assert prefill.ttft_calibration.num_samples == 24
        assert 0.5 <= prefill.ttft_calibration.factor <= 3.0
        # Both factors are exported for operators (one gauge per pod and SLO).
        text = (await client.get("/metrics")).text
        for address, slo, factor in ((h.decode[0].address, "tpot", state.tpot_calibration.factor),
                                     (h.prefill[0].address, "ttft", prefill.ttft_calibration.factor)):
            line = f'cbserve_router_latency_calibration{{pod="{address}",role="router",slo="{slo}"}}'
            assert f"{line} {factor!r}" in text or any(
                row.startswith(line) and float(row.split()[-1]) == pytest.approx(factor) for row in text.splitlines())


@pytest.mark.parametrize("waited,expected", [(0.0, ("p1", "d1")), (0.1, ("p1", "d1")), (0.3, "slo"), (2.0, "slo")])
def test_a_queued_request_is_routed_on_the_ttft_budget_it_has_left(waited, expected):
    """Predicted TTFT 0.35 s (250 queued + 100 own tokens at 1000 tokens/s) against a 0.5 s SLO:
    fits fresh or after 0.1 s in the router's queue, not after 0.3 s (the client would see 0.65 s)."""
    from router.dispatch import with_ttft_budget_left

    pods = _pods([pod("p1", queued_tokens=250)], [pod("d1", "decode")])
    routing = with_ttft_budget_left(request(100), waited)
    assert routing.slo_ttft_seconds == pytest.approx(max(1e-3, 0.5 - waited))
    decision = build_policy("goodput", PrefixIndex()).route(routing, pods)
    if expected == "slo":
        assert isinstance(decision, NoRoute) and decision.reason == "slo"
    else:
        assert (decision.prefill.address, decision.decode.address) == expected


@pytest.mark.parametrize("factor,expected", [(1.0, "slo"), (0.6, ("p1", "d1")), (2.0, "slo")])
def test_goodput_judges_ttft_by_the_calibrated_prediction(factor, expected):
    """Raw queue model: (500 queued + 100) / 1000 tokens/s = 0.6 s, over a 0.5 s SLO. A pod whose
    clients saw 0.6x its predictions (a pessimistic model) is predicted at 0.36 s and admits."""
    p1 = pod("p1", queued_tokens=500)
    for _ in range(p1.ttft_calibration.min_samples):
        p1.ttft_calibration.observe(factor, 1.0)
    assert p1.ttft_calibration.factor == pytest.approx(factor)
    decision = build_policy("goodput", PrefixIndex()).route(request(100), _pods([p1], [pod("d1", "decode")]))
    if expected == "slo":
        assert isinstance(decision, NoRoute) and decision.reason == "slo"
    else:
        assert (decision.prefill.address, decision.decode.address) == expected
        assert decision.predicted_ttft_seconds == pytest.approx(0.6)   # uncalibrated, for calibrating
