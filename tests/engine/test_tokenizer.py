"""`engine.tokenizer` against `transformers.AutoTokenizer` on a byte-level and a locally trained BPE tokenizer."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jinja2
import pytest
from hypothesis import example, given, settings, strategies as st
from tokenizers import Tokenizer as BackendTokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from engine.tokenizer import ChatTemplateError, Tokenizer, TokenizerError, build_byte_level_tokenizer

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama-3-like, written with indented block tags so trim_blocks / lstrip_blocks matter.
LLAMA3_TEMPLATE = """{{- bos_token }}
{% if tools is not none %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools:\\n' }}
    {% for tool in tools %}
{{ tool | tojson(indent=2) }}
    {% endfor %}
    {{- '<|eot_id|>' }}
{% endif %}
{% for message in messages %}
    {% if loop.index > 50 %}{% break %}{% endif %}
    {% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
        {{ raise_exception('Unsupported role: ' + message['role']) }}
    {% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{% endif %}"""

WORDS = ["the", "model", "serves", "tokens", "prefill", "decode", "cache", "block", "über", "naïve", "日本語",
         "emoji🙂", "request", "stream", "  spaced", "\n", "x=1;", "don't", "it's"]
TEXTS = ["", " ", "hello world", "The model serves tokens, fast!", "naïve über 日本語 🙂👍🏽", "don't stop .",
         "<s> literal </s> and <|eot_id|> inside", "tabs\tand\nnewlines\r\n", "a" * 50, "🤖" * 5]
MESSAGES = [
    {"role": "system", "content": "You are terse.  "},
    {"role": "user", "content": "Why is the sky blue? <b>&</b>"},
    {"role": "assistant", "content": "Rayleigh scattering."},
    {"role": "user", "content": "And sunsets 🌅?"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def build_bpe_tokenizer(out_dir: Path) -> Path:
    """Train a ~300-merge byte-level BPE on a synthetic corpus and save it like a Llama-3 checkpoint."""
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(400)]
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + 300 + len(LLAMA3_SPECIALS), special_tokens=LLAMA3_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus, trainer)
    bos_id = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos_id)])
    out_dir.mkdir(parents=True, exist_ok=True)
    backend.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True, "model_max_length": 8192,
              "chat_template": LLAMA3_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    eos_ids = [backend.token_to_id("<|end_of_text|>"), backend.token_to_id("<|eot_id|>")]
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return out_dir


@pytest.fixture(scope="module", params=["byte_level", "bpe"])
def pair(request, tmp_path_factory):
    """(our tokenizer, transformers' tokenizer, directory) for each kind."""
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "byte_level":
        build_byte_level_tokenizer(out, vocab_size=272)
    else:
        build_bpe_tokenizer(out)
    return Tokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(out), out


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(pair, text):
    ours, hf, _ = pair
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=30))
@example(text="<s>")
def test_random_text_matches_transformers(pair, text):
    ours, hf, _ = pair
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"]
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    # Special-token text ("<s>") is parsed as that token on both sides and skipped when decoding
    # (hypothesis found it): only text without one round-trips exactly.
    if not any(special in text for special in hf.all_special_tokens):
        assert ours.decode(ids) == text


def test_special_tokens_match_transformers(pair):
    ours, hf, _ = pair
    assert ours.bos_token_id == hf.bos_token_id is not None
    assert ours.eos_token_ids[0] == hf.eos_token_id
    assert ours.all_special_ids == hf.all_special_ids
    assert ours.vocab_size == len(hf)
    assert ours.model_max_length == hf.model_max_length


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, add_generation_prompt):
    ours, hf, _ = pair
    text = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.encode_chat(MESSAGES, add_generation_prompt) == hf.apply_chat_template(
        MESSAGES, add_generation_prompt=add_generation_prompt)["input_ids"]
    assert ours.encode_chat(MESSAGES)[0] == ours.bos_token_id  # the template supplies the one bos
    assert ours.encode_chat(MESSAGES)[1] != ours.bos_token_id


def test_tools_render_like_transformers(pair):
    ours, hf, _ = pair
    text = ours.apply_chat_template(MESSAGES[1:2], tools=TOOLS)
    assert text == hf.apply_chat_template(MESSAGES[1:2], tools=TOOLS, add_generation_prompt=True, tokenize=False)


def test_template_rejection_is_a_chat_template_error(pair):
    ours, hf, _ = pair
    bad = [{"role": "robot", "content": "beep"}]
    with pytest.raises(ChatTemplateError, match="robot"):
        ours.apply_chat_template(bad)
    with pytest.raises(jinja2.TemplateError):
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError):
        ours.apply_chat_template(["not a dict"])  # type: ignore[list-item]
    with pytest.raises(ChatTemplateError, match="tools"):
        ours.apply_chat_template(MESSAGES, tools=["get_weather"])  # type: ignore[list-item]


def test_generation_config_adds_eos_ids(tmp_path):
    tokenizer = Tokenizer.from_pretrained(build_bpe_tokenizer(tmp_path))
    eot, end = tokenizer.token_to_id("<|eot_id|>"), tokenizer.token_to_id("<|end_of_text|>")
    assert tokenizer.eos_token_ids == (eot, end)


def test_config_bos_eos_flags_defer_to_tokenizer_json(tmp_path):
    # transformers 5 ignores add_bos_token / add_eos_token when tokenizer.json exists.
    build_byte_level_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(add_bos_token=False, add_eos_token=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert ours.encode("hi") == hf("hi")["input_ids"] == [1, 4 + ord("h"), 4 + ord("i")]
    assert ours.add_bos_token is False and ours.add_eos_token is True


def test_chat_template_file_wins_over_config(tmp_path):
    build_byte_level_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    ours, hf = Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert ours.apply_chat_template(MESSAGES) == hf.apply_chat_template(MESSAGES, tokenize=False) \
        == "[You are terse.  ][Why is the sky blue? <b>&</b>][Rayleigh scattering.][And sunsets 🌅?]"


def test_byte_level_layout_and_determinism(tmp_path):
    first = build_byte_level_tokenizer(tmp_path / "a", vocab_size=300)
    second = build_byte_level_tokenizer(tmp_path / "b", vocab_size=300)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    tokenizer = Tokenizer.from_pretrained(first)
    assert tokenizer.encode("A é") == [1, 4 + 65, 4 + 32, 4 + 0xC3, 4 + 0xA9]
    assert tokenizer.vocab_size == 300 and tokenizer.eos_token_ids == (2,) and tokenizer.bos_token_id == 1
    assert tokenizer.decode([1, 4 + 104, 299, 2]) == "h<|extra_39|>"
    with pytest.raises(TokenizerError, match="vocab_size"):
        build_byte_level_tokenizer(tmp_path / "c", vocab_size=100)


def test_loading_errors_are_clear(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="invalid"):
        Tokenizer.from_pretrained(tmp_path)

    good = build_byte_level_tokenizer(tmp_path / "good")
    broken = tmp_path / "broken"
    shutil.copytree(good, broken)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    (broken / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% for x in %}"}))
    with pytest.raises(TokenizerError, match="chat template"):
        Tokenizer.from_pretrained(broken)
    (broken / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": None}))
    with pytest.raises(TokenizerError, match="no chat_template"):
        Tokenizer.from_pretrained(broken).apply_chat_template(MESSAGES)
    (broken / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(TokenizerError, match="eos_token_id"):
        Tokenizer.from_pretrained(broken)
    (broken / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="JSON object"):
        Tokenizer.from_pretrained(broken)
