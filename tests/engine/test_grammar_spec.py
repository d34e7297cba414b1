"""`StructuredSpec`: kinds checked where a spec is built, a stable key, and a lossless wire form."""

import pytest

from engine.grammar.spec import StructuredSpec, StructuredSpecError, canonical_json
from engine.sampling.params import SamplingParams, SamplingParamsError, from_proto, to_proto


def test_equal_schemas_share_a_key_and_options_change_it():
    a = StructuredSpec("json_schema", canonical_json({"type": "object", "required": ["a"]}))
    b = StructuredSpec("json_schema", canonical_json({"required": ["a"], "type": "object"}))
    assert a.key == b.key
    assert StructuredSpec("json_schema", a.text, any_whitespace=True).key != a.key
    assert StructuredSpec("json_schema", a.text, after_token_ids=[5, 6]).key != a.key


@pytest.mark.parametrize("kind,text", [("xml", "x"), ("json_schema", "{not json"), ("choice", "[]"),
                                       ("choice", "[1]"), ("regex", ""), ("lark", ""), ("json_object", "x")])
def test_malformed_specs_are_refused(kind, text):
    with pytest.raises(StructuredSpecError):
        StructuredSpec(kind, text)


def test_the_spec_survives_the_wire_inside_sampling_params():
    spec = StructuredSpec("choice", canonical_json(["yes", "no"]), after_token_ids=(7, 8))
    params = SamplingParams(temperature=0.0, structured=spec)
    assert from_proto(to_proto(params)) == params
    assert from_proto(to_proto(SamplingParams())).structured is None


def test_a_bad_spec_on_the_wire_names_the_field():
    msg = to_proto(SamplingParams(structured=StructuredSpec("regex", "a+")))
    msg.structured.kind = "xml"
    with pytest.raises(SamplingParamsError) as e:
        from_proto(msg)
    assert e.value.param == "structured"
