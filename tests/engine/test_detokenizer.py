from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling.params import SamplingParams
from engine.tokenizer import Tokenizer, build_byte_level_tokenizer

BOS, EOS = 1, 2
PROMPT = [BOS, 4 + ord("Q"), 4 + ord(":")]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_byte_level_tokenizer(tmp_path_factory.mktemp("byte_level")))


def byte_ids(data: bytes) -> list[int]:
    return [4 + b for b in data]


def stream(tokenizer, ids, params, chunks=None, flush=True):
    """Feed `ids` in the given chunk sizes; returns (deltas, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, PROMPT, params)
    deltas, i = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.update(ids[i:i + size]))
        i += size
    if i < len(ids):
        deltas.append(detok.update(ids[i:]))
    if flush:
        deltas.append(detok.flush())
    return deltas, detok


def random_chunks(rng, n):
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.randint(1, 4))
    return sizes


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=30), seed=st.integers(0, 1000))
def test_deltas_concatenate_to_decode_and_never_split_a_character(tokenizer, text, seed):
    ids = byte_ids(text.encode())
    deltas, detok = stream(tokenizer, ids, SamplingParams(), random_chunks(random.Random(seed), len(ids)))
    assert "".join(d.text for d in deltas) == detok.output_text == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d.text for d in deltas)
    assert not any(d.stopped for d in deltas)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=24), seed=st.integers(0, 1000))
def test_invalid_utf8_is_released_like_decode(tokenizer, data, seed):
    ids = byte_ids(data)
    deltas, detok = stream(tokenizer, ids, SamplingParams(), random_chunks(random.Random(seed), len(ids)))
    assert detok.output_text == tokenizer.decode(ids) == data.decode("utf-8", errors="replace")


def test_emoji_waits_for_its_last_byte(tokenizer):
    ids = byte_ids("a🙂".encode())  # 'a' + 4 bytes
    detok = IncrementalDetokenizer(tokenizer, PROMPT, SamplingParams())
    texts = [detok.update([i]).text for i in ids]
    assert texts == ["a", "", "", "", "🙂"]


def expected_stop(text, stops, include):
    """The stop string that completes first (shortest text), as streaming sees it."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, start, stop = min(hits, key=lambda h: (h[0], h[1]))
    return text[: end if include else start], stop


@settings(max_examples=80, deadline=None)
@given(words=st.lists(st.sampled_from(["ab", "c", "é", "🙂", "END", "E", "N", "\n", " "]), max_size=14),
       stops=st.lists(st.sampled_from(["END", "\n\n", "é🙂", "bc", "NE", "🙂🙂🙂", "c E"]), min_size=1, max_size=3),
       include=st.booleans(), seed=st.integers(0, 1000))
def test_stop_strings_cut_across_tokens_and_never_leak(tokenizer, words, stops, include, seed):
    text = "".join(words)
    ids = byte_ids(text.encode())
    params = SamplingParams(stop=tuple(stops), include_stop_str_in_output=include)
    deltas, detok = stream(tokenizer, ids, params, random_chunks(random.Random(seed), len(ids)))
    want_text, want_stop = expected_stop(text, stops, include)
    assert detok.output_text == "".join(d.text for d in deltas) == want_text
    assert detok.stopped == (want_stop is not None) and deltas[-1].stop_reason == want_stop
    streamed = ""
    for delta in deltas:
        streamed += delta.text
        assert want_text.startswith(streamed)
        if not include:
            assert not any(s in streamed for s in stops)


def test_held_back_stop_prefix_is_released_by_flush(tokenizer):
    params = SamplingParams(stop=("END",))
    detok = IncrementalDetokenizer(tokenizer, PROMPT, params)
    assert detok.update(byte_ids(b"the EN")).text == "the "
    assert detok.update(byte_ids(b"E")).text == "EN"        # "ENE": only the last "E" may start "END"
    assert detok.update(byte_ids(b"x")).text == "Ex"
    assert detok.update(byte_ids(b"E")).text == ""
    final = detok.flush()
    assert final.text == "E" and not final.stopped
    assert detok.output_text == "the ENExE"


def test_after_stop_nothing_more_is_emitted(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, PROMPT, SamplingParams(stop=("x",)))
    delta = detok.update(byte_ids(b"abxcd"))
    assert (delta.text, delta.stopped, delta.stop_reason) == ("ab", True, "x")
    assert detok.update(byte_ids(b"more")) == type(delta)("", True, "x")
    assert detok.flush().text == "" and detok.output_text == "ab"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, PROMPT, SamplingParams(stop=("a",), min_tokens=3))
    texts = [detok.update(byte_ids(b"a")) for _ in range(3)]
    assert [d.text for d in texts] == ["a", "a", ""] and texts[-1].stopped
    assert detok.output_text == "aa"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip):
    ids = byte_ids(b"hi") + [BOS] + byte_ids("✓".encode()) + [3]
    deltas, detok = stream(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert detok.output_text == ("hi✓" if skip else "hi<s>✓<pad>")


@pytest.mark.parametrize("include, expected", [(False, "ok"), (True, "ok</s>")])
def test_stop_terminated_drops_the_stop_token(tokenizer, include, expected):
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include, stop=("zz",))
    detok = IncrementalDetokenizer(tokenizer, PROMPT, params)
    assert detok.update(byte_ids(b"ok"), stop_terminated=False).text == "ok"
    detok.update(byte_ids("é".encode())[:1])  # half a character, then the request ends on eos
    detok.update([EOS], stop_terminated=True)
    assert detok.output_text.startswith("ok\ufffd")
    assert detok.output_text.removeprefix("ok\ufffd") == expected.removeprefix("ok")


def test_works_with_an_empty_prompt(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert detok.update(byte_ids("hé".encode())).text == "hé"


def test_prompt_context_keeps_the_leading_space_of_sentencepiece_words(tmp_path):
    """A Metaspace decoder drops the space of the first word it decodes; mid-sentence it must stay."""
    from tokenizers import Tokenizer as BackendTokenizer, decoders, models, pre_tokenizers

    backend = BackendTokenizer(models.WordLevel({"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    assert tokenizer.encode("Hello world") == [1, 2]
    assert tokenizer.decode([2, 3]) == "world!"

    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    assert [detok.update([t]).text for t in (2, 3, 2)] == [" world", "!", " world"]
    assert tokenizer.decode([1]) + detok.output_text == tokenizer.decode([1, 2, 3, 2])
