"""Constrained decoding in the engine, on the tiny preset's random weights: only the grammar can
make these outputs valid, so every check below is the grammar's doing.

Property-based specs (JSON schemas, regexes, choices) give valid outputs every time; a grammar
request gives the same tokens alone or batched with free ones, with async scheduling or without,
and through a prefill -> decode handoff (engine level here; real pods in tests/pods); the edges:
a finished grammar stops its request over `ignore_eos`/`min_tokens`, whitespace is bounded,
`after_token_ids` frees the output until a marker, errors end a request and nothing else.
"""

from __future__ import annotations

import math
import random
import re
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig, EngineRequestError
from engine.grammar.backend import GrammarCompileError
from engine.grammar.spec import StructuredSpec, canonical_json
from engine.grammar.structured_outputs import FirstTokenRejected
from engine.presets import resolve_model_dir
from engine.sampling.params import SamplingParams
from tests.engine.structured_cases import SMALL_SPECS, SPECS, check_complete, choice_spec, json_spec, regex_spec

ENOUGH = 96   # max_tokens that every bounded spec below fits in


def make_engine(async_scheduling: bool = False, role: str = "colocated", num_blocks: int = 256, **kw) -> Engine:
    return Engine(EngineConfig(model="tiny", role=role, async_scheduling=async_scheduling,
                               cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                               scheduler=SchedulerConfig(max_num_batched_tokens=64, **kw)))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine()


def _prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(4, 260) for _ in range(n - 1)]


def _params(spec: StructuredSpec, **kw) -> list[SamplingParams]:
    """Greedy and two seeded samplers over the spec."""
    base = dict(max_tokens=ENOUGH, structured=spec, **kw)
    return [SamplingParams(temperature=0.0, **base), SamplingParams(temperature=1.0, seed=11, **base),
            SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=12, **base)]


def _check_all(engine: Engine, spec: StructuredSpec, outputs) -> None:
    for out in outputs:
        if out.finish_reason == "stop":
            check_complete(spec, out.text)
        else:   # a length ending is a prefix the grammar accepts
            assert out.finish_reason == "length"
            _replay(engine, spec, out.output_token_ids)


def _replay(engine: Engine, spec: StructuredSpec, tokens: list[int]) -> None:
    matcher = engine.structured.compile_future(spec).result().matcher()
    for token in tokens:
        assert matcher.accept(token), matcher.error


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_output_matches_its_spec(engine, name):
    spec = SPECS[name]
    outputs = engine.generate([_prompt(s, 5 + 9 * s) for s in range(3)], _params(spec))
    assert all(o.finish_reason == "stop" for o in outputs), [o.finish_reason for o in outputs]
    _check_all(engine, spec, outputs)


# -- property-based specs --------------------------------------------------------------------------

_WORDS = st.text(alphabet="abcxyz_-é", min_size=1, max_size=4)
_LEAVES = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 500)),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 5)),
    st.builds(lambda words: {"enum": sorted(set(words))}, st.lists(_WORDS, min_size=1, max_size=4)),
    st.builds(lambda word: {"const": word}, _WORDS),
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    def build(props: dict, required: list) -> dict:
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": sorted(k for k in props if k in required)}
    return st.builds(build, st.dictionaries(_WORDS, children, min_size=1, max_size=3),
                     st.lists(_WORDS, max_size=3))


_SCHEMAS = st.recursive(
    _LEAVES, lambda children: st.one_of(
        _object(children),
        st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, children, st.integers(0, 3)),
        st.builds(lambda a, b: {"anyOf": [a, b]}, children, children)),
    max_leaves=6)

_ATOMS = st.sampled_from(["[a-z]", "[0-9]", "[A-F0-9]", "x", "ab", "\\.", "-", "é", "[xyz]"])
_REGEXES = st.recursive(
    _ATOMS, lambda inner: st.one_of(
        st.builds(lambda a, b: a + b, inner, inner),
        st.builds(lambda a, b: f"({a}|{b})", inner, inner),
        st.builds(lambda a, lo, extra: f"({a}){{{lo},{lo + extra}}}", inner, st.integers(0, 2), st.integers(0, 2)),
        st.builds(lambda a: f"({a})?", inner)),
    max_leaves=6)
_CHOICES = st.lists(st.text(alphabet="ab c\"\\é{", min_size=1, max_size=6), min_size=1, max_size=5, unique=True)
_PROPERTY = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_PROPERTY
@given(schema=_SCHEMAS.filter(lambda s: isinstance(s, dict) and "const" not in s and "enum" not in s)
       .map(lambda s: s if s.get("type") == "object" else {"type": "object", "properties": {"v": s},
                                                              "required": ["v"], "additionalProperties": False}))
def test_generated_json_schemas_give_valid_json(engine, schema):
    spec = json_spec(schema)
    outputs = engine.generate([_prompt(1)] * 2, _params(spec)[1:])
    _check_all(engine, spec, outputs)


@_PROPERTY
@given(pattern=_REGEXES)
def test_generated_regexes_give_full_matches(engine, pattern):
    spec = regex_spec(pattern)
    outputs = engine.generate([_prompt(2)] * 2, _params(spec)[1:])
    assert all(o.finish_reason == "stop" for o in outputs)
    _check_all(engine, spec, outputs)


@_PROPERTY
@given(choices=_CHOICES)
def test_generated_choices_give_one_of_them(engine, choices):
    spec = choice_spec(choices)
    outputs = engine.generate([_prompt(3)] * 2, _params(spec)[1:])
    assert all(o.finish_reason == "stop" for o in outputs)
    _check_all(engine, spec, outputs)


def test_json_object_and_lark_kinds(engine):
    outputs = engine.generate([_prompt(4)], [SamplingParams(temperature=1.0, seed=1, max_tokens=20,
                                                            structured=StructuredSpec("json_object"))])
    _check_all(engine, StructuredSpec("json_object"), outputs)
    lark = 'start: "call " NAME "(" %json {"type": "integer", "minimum": 0, "maximum": 99} ")"\nNAME: /[a-z]{1,5}/'
    outputs = engine.generate([_prompt(5)] * 2, _params(StructuredSpec("lark", lark))[1:])
    for out in outputs:
        assert out.finish_reason == "stop" and re.fullmatch(r"call [a-z]{1,5}\((\d|[1-9]\d)\)", out.text), out.text


# -- the same tokens whatever else happens -----------------------------------------------------------

def _summary(outputs):
    return [(o.output_token_ids, o.finish_reason) for o in outputs]


def test_batch_invariance_with_free_requests(engine):
    """Row mapping: each grammar request gets its own mask wherever it sits in the batch."""
    constrained = [(_prompt(20 + i, 8 + 5 * i), p)
                   for i, p in enumerate(_params(SMALL_SPECS["json"])[1:2] + _params(SMALL_SPECS["regex"])[:2])]
    free = [(_prompt(40 + i, 6 + 7 * i), SamplingParams(temperature=t, seed=i, max_tokens=8))
            for i, t in enumerate([0.0, 1.0])]
    alone = [_summary(engine.generate([p], [sp]))[0] for p, sp in constrained + free]
    for order in (constrained + free, [free[1], constrained[2], free[0], constrained[1], constrained[0]]):
        outs = dict(zip([id(x) for x in order], _summary(engine.generate([p for p, _ in order], [sp for _, sp in order]))))
        assert [outs[id(x)] for x in constrained + free] == alone


def _abort_one_midway(engine: Engine, prompts, params, victim: int, at_step: int = 3) -> list[list[int]]:
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params)]
    tokens = {rid: [] for rid in ids}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
        if steps == at_step:
            engine.abort(ids[victim])
    return [tokens[rid] for rid in ids]


def test_masks_filled_ahead_equal_masks_filled_in_prepare(engine):
    """A CPU engine fills the next step's masks in `advance` (`engine.grammar.fill_ahead`, on a
    thread while torch leaves a core idle); rows that moved (here: a request aborted mid-batch) are
    filled again in `prepare`: the outputs equal those of masks all filled in `prepare` (a GPU
    engine's)."""
    specs = list(SMALL_SPECS.values())
    prompts = [_prompt(100 + i, 3 + i % 4) for i in range(12)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=6 + i % 5, structured=specs[i % 3] if i % 6 else None)
              for i in range(12)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # a core left idle: the fill goes to the thread
    try:
        ahead = _abort_one_midway(engine, prompts, params, victim=3)
    finally:
        torch.set_num_threads(threads)
    assert engine.structured._ahead._thread is not None or engine.structured._ahead._num_cores == 1
    saved, engine.structured._ahead = engine.structured._ahead, None
    try:
        assert _abort_one_midway(engine, prompts, params, victim=3) == ahead
    finally:
        engine.structured._ahead = saved
    assert engine.stats().kv_cache_usage == 0.0 and not engine.structured.states


def test_the_steady_batch_equals_rows_taken_request_by_request(engine):
    """At 100% structured traffic `prepare` takes the list `advance` kept going (no per-row
    loop); with that list dropped after every `advance` each row is looked at again: the same
    outputs, an abort in mid-batch included."""
    specs = list(SMALL_SPECS.values())
    prompts = [_prompt(120 + i, 3 + i % 4) for i in range(6)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=5 + i % 4, structured=specs[i % 3]) for i in range(6)]
    structured = engine.structured
    looked_at = []
    rows = structured._rows
    structured._rows = lambda requests: looked_at.append(len(requests)) or rows(requests)
    try:
        steady = _abort_one_midway(engine, prompts, params, victim=2)
        steps = len(looked_at)
        advance = structured.advance

        def advance_then_drop(requests):
            out = advance(requests)
            structured._going = None
            return out
        structured.advance = advance_then_drop
        try:
            assert _abort_one_midway(engine, prompts, params, victim=2) == steady
        finally:
            del structured.advance
    finally:
        del structured._rows
    assert steps < len(looked_at) - steps           # the first run took the steady path on some steps
    assert engine.stats().kv_cache_usage == 0.0 and not structured.states


def test_async_scheduling_equals_sync(engine):
    async_engine = make_engine(async_scheduling=True)
    assert async_engine.async_scheduling
    prompts, params = [], []
    for i, spec in enumerate(SMALL_SPECS.values()):
        for sp in _params(spec)[:2] + [SamplingParams(temperature=0.5, seed=i, max_tokens=10)]:
            prompts.append(_prompt(60 + len(prompts), 5 + 3 * len(prompts)))
            params.append(sp)
    assert _summary(async_engine.generate(prompts, params)) == _summary(engine.generate(prompts, params))
    assert async_engine.stats().kv_cache_usage == 0.0 and not async_engine.structured.states


def test_preemption_recomputes_without_accepting_twice():
    """A pool too small for the batch preempts and recomputes; the matchers follow output
    positions, so the outputs equal an unpreempted run's (a second accept would break them)."""
    roomy, tight = make_engine(), make_engine(num_blocks=12)
    prompts = [_prompt(70 + i, 40) for i in range(4)]
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=30, structured=SMALL_SPECS["json"]) for i in range(4)]
    want = roomy.generate(prompts, params)
    got = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert _summary(got) == _summary(want)
    _check_all(roomy, SMALL_SPECS["json"], got)


# -- edges -----------------------------------------------------------------------------------------

def test_a_complete_grammar_stops_over_ignore_eos_and_min_tokens(engine):
    spec = choice_spec(["yes", "no"])
    for params in (SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, structured=spec),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=40, min_tokens=30, structured=spec),
                   SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40, ignore_eos=True, structured=spec)):
        out = engine.generate([_prompt(7)], params)[0]
        assert out.finish_reason == "stop" and out.text in ("yes", "no"), (out.finish_reason, out.text)


def test_min_tokens_yields_only_where_the_grammar_allows_nothing_else(engine):
    """A regex that may end or go on: min_tokens keeps eos banned while more is allowed."""
    spec = regex_spec("a{1,30}")
    out = engine.generate([_prompt(8)], SamplingParams(temperature=1.0, seed=5, max_tokens=40, min_tokens=12,
                                                        structured=spec))[0]
    assert out.finish_reason == "stop" and re.fullmatch("a{12,30}", out.text), out.text


def test_json_whitespace_is_bounded_by_default(engine):
    """Each gap holds nothing, a space, or a newline and up to 24 spaces/tabs of indentation;
    `any_whitespace` lifts the bound (and the random model uses it)."""
    schema = {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 4}
    gaps = {}
    for any_ws in (False, True):
        outs = engine.generate([_prompt(9 + i) for i in range(2)],
                               [SamplingParams(temperature=1.0, seed=i, max_tokens=80,
                                               structured=json_spec(schema, any_whitespace=any_ws)) for i in range(2)])
        gaps[any_ws] = [g for o in outs for g in re.findall(r"\s+", o.text)]
        if not any_ws:
            assert all(o.finish_reason == "stop" for o in outs)
            _check_all(engine, json_spec(schema), outs)
    assert all(re.fullmatch(r"\n[ \t]{0,24}| ", g) for g in gaps[False]), gaps[False]
    assert not all(re.fullmatch(r"\n[ \t]{0,24}| ", g) for g in gaps[True]), gaps[True]


def test_after_token_ids_free_until_the_marker(engine):
    prompt = _prompt(10, 20)
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    marker = tuple(free.output_token_ids[3:5])
    spec = regex_spec("[0-9]{3}", after_token_ids=marker)
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, structured=spec))[0]
    start = next(i + 2 for i in range(len(out.output_token_ids)) if tuple(out.output_token_ids[i:i + 2]) == marker)
    assert out.output_token_ids[:start] == free.output_token_ids[:start]       # free until the marker
    assert re.fullmatch("[0-9]{3}", engine.tokenizer.decode(out.output_token_ids[start:]))
    assert out.finish_reason == "stop"


def test_padded_logits_never_sample_a_padding_id(tmp_path):
    """A checkpoint with more logits than tokens (300 vs the byte-level tokenizer's 260)."""
    from tests.engine.hf_models import make_hf_model
    make_hf_model("llama_gqa", tmp_path)
    shutil.copytree(resolve_model_dir("tiny"), tmp_path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("config.json", "*.safetensors*", "model*"))
    padded = Engine(EngineConfig(model=str(tmp_path), cache=CacheConfig(num_blocks=64)))
    assert padded.model_config.vocab_size == 300 > padded.tokenizer.vocab_size
    free = padded.generate([_prompt(11)], SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True))[0]
    assert any(t >= 260 for t in free.output_token_ids)       # unconstrained, padding ids do come up
    outs = padded.generate([_prompt(11)] * 2, _params(SMALL_SPECS["json"])[:2])
    assert all(t < 260 for o in outs for t in o.output_token_ids)
    _check_all(padded, SMALL_SPECS["json"], outs)


def test_logprobs_are_over_the_constrained_distribution(engine):
    """The mask comes before logprobs (vLLM's order): the top alternatives are allowed tokens only."""
    req = engine.add_request(_prompt(12), SamplingParams(temperature=1.0, seed=2, max_tokens=5, logprobs=5,
                                                         structured=regex_spec("[0-9]{5}")))
    steps = []
    while engine.has_unfinished_requests():
        steps += [o.new_logprobs[0] for o in engine.step() if o.request_id == req.request_id]
    digits = {engine.tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)}
    assert len(steps) == 5
    for lp in steps:
        assert {token for token, _ in lp.top} <= digits and len(lp.top) == 5
        assert abs(sum(math.exp(v) for _, v in lp.top) - 1) < 1 - 5 / 10 + 1e-6   # mass on digits only


def test_a_grammar_that_does_not_compile_fails_only_its_request(engine):
    bad = StructuredSpec("lark", "start: missing_rule")
    good = SamplingParams(temperature=0.0, max_tokens=8)
    bad_req = engine.add_request(_prompt(13), SamplingParams(max_tokens=8, structured=bad))
    good_req = engine.add_request(_prompt(14), good)
    outputs, failures = {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = o
        failures.update(engine.take_failures())
    assert isinstance(failures[bad_req.request_id], GrammarCompileError)
    assert "missing_rule" in str(failures[bad_req.request_id])
    assert bad_req.request_id not in outputs and outputs[good_req.request_id].finished
    assert engine.stats().kv_cache_usage == 0.0 and not engine.structured.states
    with pytest.raises(GrammarCompileError):
        engine.generate([_prompt(13)], SamplingParams(max_tokens=8, structured=bad))


def test_a_model_without_a_tokenizer_refuses_structured_requests(tmp_path):
    for item in resolve_model_dir("tiny").iterdir():
        if item.name != "tokenizer.json":
            (tmp_path / item.name).symlink_to(item)
    bare = Engine(EngineConfig(model=str(tmp_path), cache=CacheConfig(num_blocks=16)))
    with pytest.raises(EngineRequestError, match="tokenizer"):
        bare.add_request([1, 5, 6], SamplingParams(structured=SPECS["regex"]))


# -- prefill -> decode handoff (engine level; real pods in tests/pods/test_structured_pods.py) ----------

def _handoff(prompts, params, fingerprint=None, token=None, async_decode=True):
    """Prefill engine samples token 0; decode engine lands it (KV copied as the transfer layer
    would), or refuses it and prefills locally. Returns (outputs by request, refusals)."""
    prefill, decode = make_engine(role="prefill"), make_engine(async_decode, role="decode")
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        prefill.add_request(prompt, sp, request_id=f"r{i}")
        decode.add_request(prompt, sp, request_id=f"r{i}", remote_kv=True)
    first = {}
    while prefill.has_unfinished_requests():
        for o in prefill.step():
            first[o.request_id] = o.new_token_ids[0]
    results, refused, landed = {}, [], set()
    while decode.has_unfinished_requests():
        for rid in decode.last_schedule.reserved_request_ids if decode.last_schedule else ():
            if rid in landed:
                continue
            landed.add(rid)
            req = decode.scheduler.get_request(rid)
            spec = req.sampling_params.structured
            fp = fingerprint if fingerprint is not None else (prefill.structured.fingerprint(spec) if spec else "")
            decode.structured.compile_future(spec).result() if spec else None
            for s, d in zip(prefill.scheduler.held[rid].block_ids, req.block_ids):
                decode.kv_cache[d].copy_(prefill.kv_cache[s])
            try:
                out = decode.land_remote_kv(rid, first[rid] if token is None else token, None, fp)
            except FirstTokenRejected as e:
                refused.append(e.reason)
                assert decode.fall_back_to_local_prefill(rid)
                continue
            results.setdefault(rid, []).extend(out.new_token_ids)
        for o in decode.step():
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert decode.stats().kv_cache_usage == 0.0
    return [results[f"r{i}"] for i in range(len(prompts))], refused, decode


def test_handoff_equals_colocated_greedy_and_seeded(engine):
    prompts = [_prompt(80 + i, 10 + 9 * i) for i in range(5)]
    params = _params(SMALL_SPECS["json"])[:2] + _params(SPECS["regex"])[1:] + _params(choice_spec(["a", "bb"]))[2:]
    want = [o.output_token_ids for o in engine.generate(prompts, params)]
    got, refused, decode = _handoff(prompts, params)
    assert got == want and not refused
    assert decode.take_failures() == []


@pytest.mark.parametrize("fault", ["fingerprint", "token"])
def test_a_refused_first_token_falls_back_to_a_local_prefill(engine, fault):
    prompts = [_prompt(90 + i, 14) for i in range(2)]
    params = _params(SPECS["regex"])[1:]
    want = [o.output_token_ids for o in engine.generate(prompts, params)]
    bos = engine.tokenizer.bos_token_id      # no grammar here allows a special token
    got, refused, decode = _handoff(prompts, params, fingerprint="f" * 64 if fault == "fingerprint" else None,
                                    token=bos if fault == "token" else None)
    assert refused == [fault] * 2 and got == want
    stats = decode.structured.take_stats()
    assert stats.first_token_rejected[fault] == 2
