"""A Hugging Face tokenizer directory read without `transformers`: encode, decode, chat templates.

Torch-free (the router tokenizes). `tokenizer.json` runs in the `tokenizers` library; the rest of
what `transformers.AutoTokenizer` does for a fast tokenizer is reproduced here and pinned by tests
against `transformers` itself:
- named special tokens come from `tokenizer_config.json`, then `special_tokens_map.json`; one that is
  not yet an added token becomes an added special token (so it is never split);
- bos/eos are added by `tokenizer.json`'s post-processor alone: transformers 5 drops the config's
  `add_bos_token` / `add_eos_token` when a `tokenizer.json` exists (they are kept as attributes);
- `decode` applies `clean_up_tokenization_spaces` only to non-BPE models (as transformers 5 does);
- chat templates render in jinja2's immutable sandbox with `trim_blocks`/`lstrip_blocks`,
  `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, and the named special
  tokens as variables; `chat_template.jinja` in the directory wins over the config's template.

`build_byte_level_tokenizer` writes the small deterministic tokenizer the model presets use.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer as BackendTokenizer, processors

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A missing or invalid tokenizer directory, or a chat template that cannot be compiled."""


class ChatTemplateError(TokenizerError):
    """The chat template rejected the messages (its `raise_exception`) or failed while rendering."""


class Tokenizer:
    """Encode/decode and chat templates for one model; build it with `Tokenizer.from_pretrained`."""

    def __init__(self, backend: BackendTokenizer, config: Mapping[str, Any], *,
                 special_tokens: Mapping[str, str], extra_special_tokens: Sequence[str] = (),
                 chat_template: str | None = None, generation_eos_ids: Sequence[int] = ()) -> None:
        self._backend = backend
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)   # tokenizers < 0.21
        self.special_tokens = dict(special_tokens)   # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
        self.extra_special_tokens = tuple(extra_special_tokens)
        self.chat_template = chat_template
        self.model_max_length: int | None = config.get("model_max_length")
        # Informational only (see the module note): tokenizer.json's post-processor decides.
        self.add_bos_token: bool | None = config.get("add_bos_token")
        self.add_eos_token: bool | None = config.get("add_eos_token")
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE")
        self._add_special_named_tokens()
        eos = [self.token_to_id(self.special_tokens["eos_token"])] if "eos_token" in self.special_tokens else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *generation_eos_ids]))
        self.bos_token_id: int | None = (
            self.token_to_id(self.special_tokens["bos_token"]) if "bos_token" in self.special_tokens else None)
        self._template = _compile_template(chat_template) if chat_template is not None else None

    # -- loading -----------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `special_tokens_map.json`,
        `generation_config.json`, `chat_template.jinja` where present) from a directory."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"no tokenizer.json in {directory} (only fast tokenizers are supported)")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception on malformed files
            raise TokenizerError(f"invalid {tokenizer_file}: {exc}") from exc
        config = _read_json(directory / "tokenizer_config.json")
        special_map = _read_json(directory / "special_tokens_map.json")

        special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = config.get(name) or special_map.get(name)
            if value:
                special_tokens[name] = _token_content(value)
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") \
            or special_map.get("additional_special_tokens") or []
        extra_tokens = [_token_content(t) for t in extra] if isinstance(extra, list) else []

        template_file = directory / "chat_template.jinja"
        chat_template = template_file.read_text(encoding="utf-8") if template_file.is_file() else \
            _pick_template(config.get("chat_template"))
        generation_eos = _read_json(directory / "generation_config.json").get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        if generation_eos is not None and not (
                isinstance(generation_eos, list) and all(type(t) is int for t in generation_eos)):
            raise TokenizerError("generation_config.json: eos_token_id must be an int or a list of ints")
        return cls(backend, config, special_tokens=special_tokens, extra_special_tokens=extra_tokens,
                   chat_template=chat_template, generation_eos_ids=generation_eos or ())

    def _add_special_named_tokens(self) -> None:
        added = {token.content for token in self._backend.get_added_tokens_decoder().values()}
        missing = [t for t in [*self.special_tokens.values(), *self.extra_special_tokens] if t not in added]
        if missing:
            self._backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                              for t in dict.fromkeys(missing)])

    # -- tokens ------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; equal to `AutoTokenizer.from_pretrained(path)(text)["input_ids"]`.

        Releases the GIL while it runs, so a long text encoded in a worker thread does not stall
        the caller's event loop."""
        # `encode` holds the GIL for the whole call; `encode_batch*` release it (and `_fast` skips
        # the character offsets nobody here reads). The ids are the same.
        return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this one token stands for (OpenAI's logprobs `bytes`), even when they are only
        part of a UTF-8 character (its decoded text alone is then U+FFFD): byte-level BPE pieces
        map back through GPT-2's byte table, SentencePiece byte-fallback pieces (`<0x0A>`) are the
        byte, `▁` is a space; added tokens and other models give their decoded text's bytes."""
        piece = self._backend.id_to_token(token_id)
        if piece is None or token_id in self._added_token_ids:
            return self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        if self._piece_encoding == "byte_level" and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if self._piece_encoding == "byte_fallback":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @functools.cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self._backend.get_added_tokens_decoder())

    @functools.cached_property
    def _piece_encoding(self) -> str:
        """How vocabulary pieces spell bytes, from tokenizer.json's decoder: "byte_level",
        "byte_fallback" or "text"."""
        decoder = json.loads(self._backend.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
        if "ByteLevel" in kinds:
            return "byte_level"
        return "byte_fallback" if "ByteFallback" in kinds else "text"

    def token_to_id(self, token: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"token {token!r} is not in the vocabulary")
        return token_id

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters of input text one token stands for.

        The longest vocabulary entry (added tokens included): byte-level BPE spells each byte as
        one character and SentencePiece-style vocabularies spell the text itself (`▁` for a
        space), so no token covers more input characters than its entry has. A normalizer can
        shrink the text before it is split (NFC composes at most 4 code points into one), so
        with one the bound is 4x. The router refuses, before tokenizing, a prompt longer than
        `max_model_len * max_chars_per_token` characters: it cannot fit."""
        longest = max((len(token) for token in self._backend.get_vocab(with_added_tokens=True)), default=1)
        return max(1, longest) * (4 if self._backend.normalizer is not None else 1)

    def to_json(self) -> str:
        """The backend's `tokenizer.json` text, the named special tokens included (grammar
        backends build their token tables from it)."""
        return self._backend.to_str()

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (`len(hf_tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the named special tokens and the extra special tokens, as transformers lists them."""
        tokens = dict.fromkeys([*self.special_tokens.values(), *self.extra_special_tokens])
        return [self.token_to_id(t) for t in tokens]

    # -- chat --------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """Render a conversation to the prompt text (HF's `apply_chat_template(..., tokenize=False)`);
        `template_kwargs` are extra template variables (vLLM's `chat_template_kwargs`)."""
        if self._template is None:
            raise TokenizerError("this tokenizer has no chat_template; use the completions API")
        if not isinstance(messages, Sequence) or not all(isinstance(m, Mapping) for m in messages):
            raise ChatTemplateError("messages must be a list of objects with 'role' and 'content'")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ChatTemplateError("tools must be a list of JSON-schema objects")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages], tools=list(tools) if tools is not None else None,
                documents=None, add_generation_prompt=add_generation_prompt,
                **{**template_kwargs, **self.special_tokens})
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered conversation; the template supplies any bos, so none is added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools),
                           add_special_tokens=False)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return value


def _token_content(value: Any) -> str:
    """Special tokens are saved as a string or as a serialised AddedToken (`{"content": ...}`)."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    if isinstance(value, str):
        return value
    raise TokenizerError(f"invalid special token entry {value!r}")


def _pick_template(value: Any) -> str | None:
    """The config holds one template, or a list of named ones of which "default" is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        raise TokenizerError(f"chat_template list has no 'default' entry (has {sorted(map(str, named))})")
    raise TokenizerError("chat_template must be a string or a list of {name, template}")


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & for HTML, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"invalid chat template: {exc}") from exc


# -- the presets' tokenizer --------------------------------------------------------------------------

BYTE_LEVEL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3 (Llama order); bytes follow
_ZEPHYR_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ('system', 'user', 'assistant') %}"
    "{{ raise_exception('unsupported role: ' ~ message['role']) }}"
    "{% endif %}"
    "{{ '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ eos_token ~ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer/decoder use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {char: byte for byte, char in _byte_to_unicode().items()}


def build_byte_level_tokenizer(out_dir: str | Path, vocab_size: int | None = None) -> Path:
    """Write a deterministic byte-level tokenizer directory that `AutoTokenizer` also loads.

    Ids: `<unk>`=0, `<s>`=1 (bos, added on encode), `</s>`=2 (eos), `<pad>`=3, byte `b` = 4 + b.
    With `vocab_size` > 260 the rest are filler tokens `<|extra_N|>`, entries of the BPE vocabulary
    that no merge produces (so encoding never emits them) and that decode to their own name (so a
    dummy-weight model that emits them still produces visible text). Vocabulary entries, not added
    tokens: 128k added tokens take seconds to load, 128k vocabulary entries a fraction of one. The chat template is
    Zephyr-style: `<|role|>\\n{content}</s>\\n` per message, then `<|assistant|>\\n`.
    """
    from tokenizers import decoders, models, pre_tokenizers

    num_base = len(BYTE_LEVEL_SPECIAL_TOKENS) + 256
    if vocab_size is not None and vocab_size < num_base:
        raise TokenizerError(f"vocab_size must be >= {num_base} for a byte-level tokenizer, got {vocab_size}")
    vocab = {token: i for i, token in enumerate(BYTE_LEVEL_SPECIAL_TOKENS)}
    vocab.update({char: len(BYTE_LEVEL_SPECIAL_TOKENS) + b for b, char in sorted(_byte_to_unicode().items())})
    # Printable ASCII is its own byte-level character: "<|extra_N|>" decodes to itself.
    vocab.update({f"<|extra_{i}|>": num_base + i for i in range(max(0, (vocab_size or 0) - num_base))})
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_LEVEL_SPECIAL_TOKENS])
    backend.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)])

    named = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **named,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "chat_template": _ZEPHYR_TEMPLATE,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(named, indent=2) + "\n", encoding="utf-8")
    return out
