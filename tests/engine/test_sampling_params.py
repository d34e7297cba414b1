from __future__ import annotations

import dataclasses

import pytest

from wire import cbserve_pb2
from engine.sampling.params import SamplingParams, SamplingParamsError, from_proto, to_proto


def test_defaults_match_the_contract():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.stop_token_ids, p.stop) == (16, 0, (), ())
    assert (p.ignore_eos, p.logprobs, p.skip_special_tokens, p.include_stop_str_in_output) == (
        False, None, True, False)
    assert not p.is_greedy
    assert SamplingParams(temperature=0).is_greedy


def test_lists_become_tuples_and_value_is_hashable():
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 4])
    assert p.stop == ("a", "bc") and p.stop_token_ids == (3, 4)
    assert SamplingParams(stop="x").stop == ("x",)
    assert hash(p) == hash(SamplingParams(stop=("a", "bc"), stop_token_ids=(3, 4)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 2.0  # type: ignore[misc]


@pytest.mark.parametrize("param, value", [
    ("temperature", -0.1), ("temperature", 101.0), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.01),
    ("top_k", -2), ("top_k", 1.5),
    ("min_p", -0.01), ("min_p", 1.5),
    ("presence_penalty", 2.1), ("presence_penalty", -2.1),
    ("frequency_penalty", 3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("max_tokens", 0), ("max_tokens", True),
    ("min_tokens", -1), ("min_tokens", 17),
    ("seed", 1 << 63), ("seed", -(1 << 63) - 1), ("seed", 1.0),
    ("logprobs", -1), ("logprobs", 21),
    ("stop", ("",)), ("stop", tuple(f"s{i}" for i in range(17))), ("stop", (3,)),
    ("stop_token_ids", (-1,)), ("stop_token_ids", ("a",)),
    ("ignore_eos", 1), ("skip_special_tokens", None),
])
def test_validation_names_the_param(param, value):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{param: value})
    assert info.value.param == param
    assert param in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(temperature=100), dict(top_p=1e-9), dict(top_k=-1), dict(top_k=1),
    dict(min_p=1.0), dict(presence_penalty=-2, frequency_penalty=2), dict(repetition_penalty=0.5),
    dict(max_tokens=1, min_tokens=1), dict(repetition_penalty=250.0), dict(seed=-(1 << 63)), dict(seed=(1 << 63) - 1),
    dict(logprobs=0), dict(logprobs=20), dict(stop=tuple("abcdefghijklmnop")),
])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_p=0.95, top_k=40, min_p=0.05, seed=-12345678901234,
                   presence_penalty=0.3, frequency_penalty=-1.1, repetition_penalty=1.15,
                   max_tokens=300, min_tokens=5, stop_token_ids=(2, 7), stop=("\n\n", "END"),
                   ignore_eos=True, logprobs=0, skip_special_tokens=False, include_stop_str_in_output=True),
    SamplingParams(temperature=0.0, logprobs=5, seed=0),
])
def test_proto_round_trip(params):
    msg = to_proto(params)
    assert isinstance(msg, cbserve_pb2.SamplingParams)
    wire = cbserve_pb2.SamplingParams.FromString(msg.SerializeToString())
    assert from_proto(wire) == params


def test_proto_optional_fields_use_presence():
    msg = to_proto(SamplingParams(seed=0, logprobs=0))
    assert msg.HasField("seed") and msg.HasField("logprobs")
    # Reusing a message clears fields the new params leave unset.
    msg = to_proto(SamplingParams(), msg)
    assert not msg.HasField("seed") and not msg.HasField("logprobs")
    assert from_proto(msg).seed is None and from_proto(msg).logprobs is None


def test_invalid_proto_is_rejected_with_param():
    msg = to_proto(SamplingParams())
    msg.top_p = 0.0
    with pytest.raises(SamplingParamsError) as info:
        from_proto(msg)
    assert info.value.param == "top_p"


def test_text_side_modules_do_not_import_torch():
    # The router imports these and must stay torch-free (and transformers-free).
    import subprocess
    import sys

    code = ("import sys, engine.sampling.params, engine.tokenizer, engine.detokenizer;"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"
