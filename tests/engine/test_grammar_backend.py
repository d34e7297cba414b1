"""The grammar backend pieces on their own: llguidance over cbserve's tokenizer, the compile
pool and its LRU, fingerprints, and a request's matcher synced to its output."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engine.grammar.backend import GrammarCompileError
from engine.grammar.compiler import GrammarCompiler
from engine.grammar.fill_ahead import FillAhead
from engine.grammar.llguidance_backend import LLGuidanceBackend
from engine.grammar.request_grammar import RequestGrammar
from engine.grammar.source import grammar_source, short_error, validate_source
from engine.grammar.spec import StructuredSpec, canonical_json
from engine.presets import resolve_model_dir
from engine.tokenizer import Tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(resolve_model_dir("tiny", create_weights=False))


@pytest.fixture(scope="module")
def backend(tokenizer) -> LLGuidanceBackend:
    return LLGuidanceBackend(tokenizer, vocab_width=300, eos_token_ids=[EOS])   # 40 padding ids


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _allowed(backend, matcher) -> set[int]:
    mask = np.zeros((2, backend.words_per_row), dtype=np.int32)
    backend.fill_bitmask([(matcher, 1)], mask)
    assert not mask[0].any()                           # only the named row is written
    return set(np.flatnonzero(np.unpackbits(mask[1].view(np.uint8), bitorder="little")).tolist())


def test_masks_name_the_allowed_bytes_and_never_a_padding_id(backend, tokenizer):
    matcher = backend.compile(StructuredSpec("regex", "[ab]c?")).matcher()
    assert _allowed(backend, matcher) == set(_ids(tokenizer, "ab"))
    assert matcher.accept(_ids(tokenizer, "a")[0])
    assert _allowed(backend, matcher) == set(_ids(tokenizer, "c")) | {EOS}     # accepting: eos too
    assert matcher.accept(_ids(tokenizer, "c")[0]) and matcher.is_terminated()
    assert _allowed(backend, matcher) == {EOS}                                  # terminated: eos only
    free = backend.compile(StructuredSpec("regex", "(?s:.*)")).matcher()
    assert max(_allowed(backend, free)) < tokenizer.vocab_size


def test_rejected_tokens_copies_and_rollback(backend, tokenizer):
    a, b, x = (_ids(tokenizer, c)[0] for c in "abx")
    matcher = backend.compile(StructuredSpec("choice", canonical_json(["ab", "ax"]))).matcher()
    assert matcher.accept(a)
    fork = matcher.copy()
    assert fork.accept(x) and fork.is_terminated() and not matcher.is_terminated()
    assert matcher.can_accept(b) and not matcher.can_accept(a) and not matcher.error
    matcher.rollback(1)
    assert matcher.can_accept(a)
    assert not matcher.accept(b) and matcher.error          # rejected: the matcher says why


def test_accept_tokens_in_one_call_equals_accept_then_is_terminated(backend, tokenizer):
    """`accept_tokens` (a step's batch): per pair what `accept` and `is_terminated` say."""
    from engine.grammar.backend import ACCEPTED, REJECTED, TERMINATED
    a, b, x = (_ids(tokenizer, c)[0] for c in "abx")
    compiled = backend.compile(StructuredSpec("choice", canonical_json(["ab", "ax", "axb"])))
    pairs = [(compiled.matcher(), a), (compiled.matcher(), b)]
    singles = [(compiled.matcher(), a), (compiled.matcher(), b)]
    assert backend.accept_tokens(pairs) == [ACCEPTED, REJECTED]
    assert [m.accept(t) for m, t in singles] == [True, False] and pairs[1][0].error == singles[1][0].error
    done, going = pairs[0][0].copy(), pairs[0][0]
    assert backend.accept_tokens([(done, b), (going, x)]) == [TERMINATED, ACCEPTED]
    assert done.is_terminated() and not going.is_terminated()
    assert backend.accept_tokens([]) == []


def test_parallel_fill_of_many_rows(backend, tokenizer):
    compiled = backend.compile(StructuredSpec("regex", "[0-9]+"))
    matchers = [compiled.matcher() for _ in range(5)]
    mask = np.zeros((8, backend.words_per_row), dtype=np.int32)
    backend.fill_bitmask([(m, 7 - i) for i, m in enumerate(matchers)], mask)
    digits = set(_ids(tokenizer, "0123456789"))
    for row in range(3, 8):
        assert set(np.flatnonzero(np.unpackbits(mask[row].view(np.uint8), bitorder="little"))) == digits
    assert not mask[:3].any()
    with pytest.raises(ValueError, match="bitmask"):
        backend.fill_bitmask([(matchers[0], 0)], np.zeros((1, 3), dtype=np.int32))


def test_rows_filled_ahead_count_only_where_they_still_match(backend, tokenizer):
    """`FillAhead` (a CPU engine's masks, filled in `advance`): a row stands for the next prepare
    only at the same mask row and output position, after the last start; inline (no idle core)
    and on the thread alike, each row the mask `fill_bitmask` gives."""
    specs = [StructuredSpec("regex", r) for r in ("[0-9]+", "[a-z]+")]
    compiled = [backend.compile(spec) for spec in specs]
    states = []
    for i in range(10):
        state = RequestGrammar(specs[i % 2], None)
        state.start(compiled[i % 2])
        states.append(state)
    want = np.zeros((len(states), backend.words_per_row), dtype=np.int32)
    backend.fill_bitmask([(s.matcher, j) for j, s in enumerate(states)], want)
    ahead, threads = FillAhead(), torch.get_num_threads()
    try:
        for num_threads, group in ((ahead._num_cores, states[:3]), (1, states)):   # inline, then on the thread
            torch.set_num_threads(num_threads)
            host = np.zeros((len(group), backend.words_per_row), dtype=np.int32)
            ahead.start(backend, group, host)
            assert ahead.stale(group) == [] and (host == want[:len(group)]).all()
            assert len(ahead.stale(group)) == len(group)       # used: stale until the next start
        host = np.zeros_like(want)
        ahead.start(backend, states, host)
        assert ahead.stale(states, untouched=True) == []        # the very list, vouched for: not compared
        ahead.start(backend, states, host)
        assert len(ahead.stale([*states], untouched=True)) == 0  # another list: compared, still fresh
        ahead.start(backend, states, host)
        moved = [states[1], states[0], *states[2:]]
        assert [j for _, j in ahead.stale(moved)] == [0, 1]
        ahead.start(backend, states[:2], host)
        ahead.start(backend, states[2:4], host)                 # overwrites rows 0-1: the first is stale
        assert len(ahead.stale(states[:2])) == 2
        ahead.start(backend, states[:2], host)
        ahead.wait()                                            # before a matcher is touched
        assert states[0].sync(_ids(tokenizer, "7"))             # consumed a token since: stale
        assert [j for _, j in ahead.stale(states[:2])] == [0]
        ahead.start(backend, states, np.zeros((len(states), 3), dtype=np.int32))
        with pytest.raises(ValueError, match="bitmask"):       # a failed fill raises at the wait
            ahead.wait()
        assert ahead._thread is not None or ahead._num_cores == 1
    finally:
        torch.set_num_threads(threads)
        ahead.close()


def test_compile_errors_are_the_requests(backend):
    with pytest.raises(GrammarCompileError, match="regex"):
        backend.compile(StructuredSpec("regex", "(("))
    assert validate_source(grammar_source(StructuredSpec("regex", "(("))) is not None
    assert validate_source(grammar_source(StructuredSpec("json_schema", '{"type":"object"}'))) is None
    assert short_error("first line\n<state>\nlots") == "first line"


def test_the_compiler_compiles_each_spec_once_off_the_calling_thread(tokenizer):
    threads = []

    def make():
        threads.append(threading.current_thread().name)
        return LLGuidanceBackend(tokenizer, 260, [EOS])
    compiler = GrammarCompiler(make, cache_size=2)
    try:
        specs = [StructuredSpec("regex", p) for p in ("a+", "b+", "c+")]
        first = compiler.compile(specs[0])
        assert compiler.compile(StructuredSpec("regex", "a+")) is first     # same key, same compile
        first.result()
        compiler.compile(specs[1]).result()
        compiler.compile(specs[2]).result()                               # evicts "a+" (LRU of 2)
        again = compiler.compile(specs[0])
        assert again is not first and again.result()
        bad = compiler.compile(StructuredSpec("regex", "(("))
        assert isinstance(bad.exception(), GrammarCompileError) and compiler.compile(
            StructuredSpec("regex", "((")) is bad                          # failures are cached too
        stats = compiler.take_stats()
        assert stats.cache_hits == 2 and len(stats.compile_seconds) == 5
        assert compiler.take_stats().cache_hits == 0
        assert threads[0].startswith("grammar-compile")
    finally:
        compiler.close()


def test_fingerprints_name_spec_tokenizer_and_width(tokenizer):
    def compiler(width):
        return GrammarCompiler(lambda: LLGuidanceBackend(tokenizer, width, [EOS]))
    a, b, wide = compiler(260), compiler(260), compiler(300)
    spec, other = StructuredSpec("regex", "a+"), StructuredSpec("regex", "a+", any_whitespace=True)
    try:
        assert a.fingerprint(spec) == b.fingerprint(spec) != a.fingerprint(other)
        assert wide.fingerprint(spec) != a.fingerprint(spec)
    finally:
        for c in (a, b, wide):
            c.close()


def test_a_request_grammar_accepts_each_output_position_once(backend, tokenizer):
    spec = StructuredSpec("regex", "[a-z]{3}", after_token_ids=tuple(_ids(tokenizer, "</t>")))
    compiled = backend.compile(StructuredSpec("regex", "[a-z]{3}"))
    state = RequestGrammar(spec, None)
    think, marker, body = _ids(tokenizer, "hm!"), _ids(tokenizer, "</t>"), _ids(tokenizer, "abc")
    output = think + marker[:2]
    assert state.sync(output) and not state.constrained                 # marker not complete yet
    output += marker[2:]
    assert state.sync(output) and state.constrained and state.constrain_from == len(output)
    output += body[:1]
    assert state.sync(output)                                           # waits for the matcher
    state.start(compiled)
    assert state.sync(output) and state.sync(output)                    # idempotent
    output += body[1:]
    assert state.sync(output + [-1]) and state.is_terminated()          # a placeholder is skipped
    assert state.sync(output)
    state.reset()
    assert not state.constrained and state.num_seen == 0 and state.matcher is None
