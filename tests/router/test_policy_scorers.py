"""Table-driven tests of each filter and scorer over fake pods (llm-d style: one table per plugin)."""

from __future__ import annotations

import random

import pytest

from policy_pods import pod, request
from router.policy.base import MaxScorePicker, Profile
from router.policy.goodput import LatencyPredictor, SLOFilter, SLOHeadroomScorer
from router.policy.kv_cache import KVCacheScorer
from router.policy.least_loaded import QueueScorer
from router.policy.prefix_affinity import PrefixAffinityScorer, PrefixIndex, block_hashes
from router.policy.round_robin import RoundRobinPicker

QUEUE_CASES = [
    # (name, metric, pods, expected scores)
    ("equal load scores 1", "requests", [pod("a", running=2), pod("b", running=2)], {"a": 1.0, "b": 1.0}),
    ("linear between min and max", "requests",
     [pod("a", running=0), pod("b", waiting=2, running=2), pod("c", running=8)], {"a": 1.0, "b": 0.5, "c": 0.0}),
    ("router in-flight counts when above the report", "requests",
     [pod("a", running=1, inflight=5), pod("b", running=3)], {"a": 0.0, "b": 1.0}),
    ("queued prefill tokens", "prefill_tokens",
     [pod("a", queued_tokens=1000), pod("b", queued_tokens=0), pod("c", queued_tokens=250)],
     {"a": 0.0, "b": 1.0, "c": 0.75}),
]


@pytest.mark.parametrize("name,metric,pods,expected", QUEUE_CASES, ids=[c[0] for c in QUEUE_CASES])
def test_queue_scorer(name, metric, pods, expected):
    assert QueueScorer(metric).score(request(), pods) == pytest.approx(expected)


def test_queue_scorer_counts_unreported_dispatches():
    a, b = pod("a", queued_tokens=100), pod("b", queued_tokens=100)
    a.on_dispatch(500)     # sent by the router after a's last report
    assert QueueScorer("prefill_tokens").score(request(), [a, b]) == {"a": 0.0, "b": 1.0}


KV_CASES = [
    ("free share", [pod("a", free_blocks=25), pod("b", free_blocks=100)], {"a": 0.25, "b": 1.0}),
    ("no report of blocks counts as free", [pod("a", free_blocks=0, total_blocks=0)], {"a": 1.0}),
]


@pytest.mark.parametrize("name,pods,expected", KV_CASES, ids=[c[0] for c in KV_CASES])
def test_kv_cache_scorer(name, pods, expected):
    assert KVCacheScorer().score(request(), pods) == pytest.approx(expected)


def test_block_hashes_chain_and_ignore_partial_block():
    ids = list(range(40))
    hashes = block_hashes(ids, 16)
    assert len(hashes) == 2                                   # 40 tokens = 2 full blocks + 8
    assert block_hashes(ids[:32], 16) == hashes
    assert block_hashes([99] + ids[1:], 16)[1] != hashes[1]   # a chain: block 1 depends on block 0


AFFINITY_CASES = [
    # (name, recorded {address: number of leading blocks sent there}, expected scores for a 4-block prompt)
    ("nothing recorded", {}, {"a": 0.0, "b": 0.0}),
    ("whole prefix on a", {"a": 4}, {"a": 1.0, "b": 0.0}),
    ("half on b", {"a": 1, "b": 2}, {"a": 0.25, "b": 0.5}),
]


@pytest.mark.parametrize("name,recorded,expected", AFFINITY_CASES, ids=[c[0] for c in AFFINITY_CASES])
def test_prefix_affinity_scorer(name, recorded, expected):
    hashes = block_hashes(list(range(64)), 16)
    index = PrefixIndex()
    for address, num_blocks in recorded.items():
        index.record(hashes[:num_blocks], address)
    scores = PrefixAffinityScorer(index).score(request(64, hashes=hashes), [pod("a"), pod("b")])
    assert scores == pytest.approx(expected)


def test_prefix_index_is_bounded_lru():
    index = PrefixIndex(max_entries=3)
    index.record([1, 2, 3], "a")
    index.record([1], "b")            # touches 1: now 2 is the oldest
    index.record([4], "a")
    assert index.matched_blocks([1], "b") == 1 and index.matched_blocks([2, 3], "a") == 0
    assert len(index) == 3


# Goodput: ttft = (queued + uncached) / rate; SLO 0.5 s; prompt 100 tokens; rate 1000 tok/s.
GOODPUT_PREFILL_CASES = [
    ("idle pod: headroom 0.8", [pod("a")], {"a": pytest.approx(0.8)}, ["a"]),
    ("queue 300: 0.4 s, still meets", [pod("a", queued_tokens=300)], {"a": pytest.approx(0.2)}, ["a"]),
    ("queue 500: 0.6 s misses", [pod("a", queued_tokens=500)], {"a": pytest.approx(-0.2)}, []),
    ("prompt alone misses on an idle pod: kept", [pod("a", rate=100)], {"a": pytest.approx(-1.0)}, ["a"]),
    ("faster pod has more headroom", [pod("a", queued_tokens=300), pod("b", queued_tokens=300, rate=4000)],
     {"a": pytest.approx(0.2), "b": pytest.approx(0.8)}, ["a", "b"]),
]


@pytest.mark.parametrize("name,pods,headroom,kept", GOODPUT_PREFILL_CASES, ids=[c[0] for c in GOODPUT_PREFILL_CASES])
def test_goodput_prefill_headroom_and_slo_filter(name, pods, headroom, kept):
    predictor = LatencyPredictor(PrefixIndex())
    req = request(100)
    assert SLOHeadroomScorer(predictor).score(req, pods) == headroom
    assert [p.address for p in SLOFilter(predictor).filter(req, pods)] == kept


def test_goodput_prefix_cache_lowers_predicted_ttft():
    index = PrefixIndex()
    hashes = block_hashes(list(range(400)), 16)             # 25 full blocks
    index.record(hashes, "warm")
    predictor = LatencyPredictor(index)
    req = request(400, hashes=hashes)
    warm, cold = pod("warm", queued_tokens=200), pod("cold", queued_tokens=200)
    assert predictor.ttft(req, cold) == pytest.approx(0.6)              # (200 + 400) / 1000
    assert predictor.ttft(req, warm) == pytest.approx((200 + 1) / 1000)  # only the last token recomputed
    assert [p.address for p in SLOFilter(predictor).filter(req, [warm, cold])] == ["warm"]


GOODPUT_DECODE_CASES = [
    # decode TPOT from the step-time EWMA until the online model has samples; SLO 50 ms
    ("fast pod", [pod("a", "decode", step=0.01)], {"a": pytest.approx(0.8)}, ["a"]),
    ("slow busy pod misses", [pod("a", "decode", step=0.06, running=3)], {"a": pytest.approx(-0.2)}, []),
    ("slow idle pod is kept: waiting cannot help", [pod("a", "decode", step=0.06)], {"a": pytest.approx(-0.2)},
     ["a"]),
    ("colocated takes the worse of ttft and tpot", [pod("a", "colocated", step=0.04, queued_tokens=0)],
     {"a": pytest.approx(0.2)}, ["a"]),
]


@pytest.mark.parametrize("name,pods,headroom,kept", GOODPUT_DECODE_CASES, ids=[c[0] for c in GOODPUT_DECODE_CASES])
def test_goodput_decode_headroom(name, pods, headroom, kept):
    predictor = LatencyPredictor(PrefixIndex())
    assert SLOHeadroomScorer(predictor).score(request(100), pods) == headroom
    assert [p.address for p in SLOFilter(predictor).filter(request(100), pods)] == kept


def test_goodput_decode_uses_fitted_step_model():
    predictor = LatencyPredictor(PrefixIndex())
    busy, idle = pod("busy", "decode", running=30, step=0.001), pod("idle", "decode", running=1, step=0.001)
    for p in (busy, idle):
        for seqs in range(1, 40):   # step = 5 ms + 1 ms per sequence
            p.step_model.add(seqs, 100 * seqs, 0, 0.005 + 0.001 * seqs)
    assert predictor.tpot(request(), busy) == pytest.approx(0.005 + 0.001 * 31, abs=1e-3)
    assert predictor.tpot(request(), idle) == pytest.approx(0.005 + 0.001 * 2, abs=1e-3)


def _fitted(p, step=lambda seqs: 0.005 + 0.001 * seqs):
    for seqs in range(1, 40):
        p.step_model.add(seqs, 100 * seqs, 0, step(seqs))
    return p


def _calibrated(p, factor: float):
    for _ in range(p.tpot_calibration.min_samples):
        p.tpot_calibration.observe(0.01 * factor, 0.01)
    return p


# Calibrated decode TPOT: model TPOT (5 ms + 1 ms per sequence, batch + 1) x factor; SLO 50 ms.
GOODPUT_CALIBRATED_CASES = [
    # (name, pods, expected headroom, kept by the SLO filter)
    ("uncalibrated: the model's TPOT", [_fitted(pod("a", "decode", running=9))], {"a": pytest.approx(0.7, abs=0.02)},
     ["a"]),
    ("a pod whose clients see 2x the model: headroom halves, then some",
     [_calibrated(_fitted(pod("a", "decode", running=9)), 2.0)], {"a": pytest.approx(0.4, abs=0.04)}, ["a"]),
    ("model meets the SLO, calibrated misses", [_calibrated(_fitted(pod("a", "decode", running=29)), 1.5)],
     {"a": pytest.approx(1 - 0.035 * 1.5 / 0.05, abs=0.04)}, []),
    ("calibration ranks: busier but honest beats idler but slow",
     [_calibrated(_fitted(pod("idle", "decode", running=4)), 3.0), _fitted(pod("busy", "decode", running=14))],
     {"idle": pytest.approx(1 - 0.010 * 3 / 0.05, abs=0.03), "busy": pytest.approx(1 - 0.020 / 0.05, abs=0.03)},
     ["idle", "busy"]),
]


@pytest.mark.parametrize("name,pods,headroom,kept", GOODPUT_CALIBRATED_CASES,
                         ids=[c[0] for c in GOODPUT_CALIBRATED_CASES])
def test_goodput_decode_headroom_uses_calibrated_tpot(name, pods, headroom, kept):
    predictor = LatencyPredictor(PrefixIndex())
    assert SLOHeadroomScorer(predictor).score(request(100), pods) == headroom
    assert [p.address for p in SLOFilter(predictor).filter(request(100), pods)] == kept
    for p in pods:
        assert predictor.tpot(request(100), p) == pytest.approx(
            predictor.model_tpot(request(100), p) * p.tpot_calibration.factor)


PICK_CASES = [
    ("highest score wins", {"a": 0.2, "b": 0.9}, {"b"}),
    ("ties broken at random", {"a": 0.5, "b": 0.5, "c": 0.1}, {"a", "b"}),
]


@pytest.mark.parametrize("name,scores,allowed", PICK_CASES, ids=[c[0] for c in PICK_CASES])
def test_max_score_picker(name, scores, allowed):
    picker = MaxScorePicker(random.Random(0))
    pods = [pod(a) for a in scores]
    picked = {picker.pick(pods, scores).address for _ in range(50)}
    assert picked == allowed


def test_round_robin_picker_cycles_in_address_order():
    picker, pods = RoundRobinPicker(), [pod("b"), pod("a"), pod("c")]
    assert [picker.pick(pods, {}).address for _ in range(4)] == ["a", "b", "c", "a"]


def test_profile_excludes_tried_pods_and_weights_scores():
    profile = Profile(scorers=[(QueueScorer("requests"), 1.0), (KVCacheScorer(), 2.0)])
    a, b = pod("a", running=0, free_blocks=10), pod("b", running=5, free_blocks=100)
    chosen, _ = profile.run(request(), [a, b])
    assert chosen is b                           # 0 + 2 * 1.0 beats 1 + 2 * 0.1
    chosen, _ = profile.run(request(exclude=frozenset({"b"})), [a, b])
    assert chosen is a
    assert profile.run(request(exclude=frozenset({"a", "b"})), [a, b]) == (None, "no_pods")
