"""Logprobs in the response shapes clients parse: completions' (OpenAI's legacy dicts, with echo),
chat's (OpenAI's lists with `bytes`), and vLLM's `prompt_logprobs`.

Never collapse, never drop: a token is shown as its decoded text, and two tokens can share one
(byte-level BPE tokens of an incomplete UTF-8 character all decode to U+FFFD). Chat lists every
alternative with its own `bytes`, so nothing is lost there. Completions' `top_logprobs` are dicts
keyed by token text, where equal texts would merge; there an alternative whose text is already a
key of the same dict is keyed `token_id:N` instead (the spelling of vLLM's
`return_tokens_as_token_ids`, which spells every token that way), so each position has exactly
the alternatives asked for (`logprobs` of them), plus the chosen token when it is not among them
(OpenAI: "up to logprobs+1 elements"). Logprobs below -9999 (and -inf, which JSON cannot carry)
are sent as -9999, as OpenAI and vLLM do.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from wire import cbserve_pb2 as pb
from engine.tokenizer import Tokenizer
from router.errors import bad_request, upstream_error

MIN_LOGPROB = -9999.0
_TABLES: weakref.WeakKeyDictionary[Tokenizer, _TokenTable] = weakref.WeakKeyDictionary()


class _TokenTable:
    """Each token's text and bytes, decoded once per tokenizer (responses ask for the same ids often)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = list(self.tokenizer.token_bytes(token_id))
        return raw


class TokenNames:
    """How tokens are spelled in one response: their text, or `token_id:N` for every token
    (`return_tokens_as_token_ids`)."""

    def __init__(self, tokenizer: Tokenizer, as_token_ids: bool = False) -> None:
        table = _TABLES.get(tokenizer)
        if table is None:
            table = _TABLES[tokenizer] = _TokenTable(tokenizer)
        self.table = table
        self.as_token_ids = as_token_ids

    def name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_token_ids else self.table.text(token_id)

    def bytes(self, token_id: int) -> list[int]:
        return self.table.bytes(token_id)

    def top_dict(self, alternatives: Sequence[tuple[int, float]]) -> dict[str, float]:
        """`{name: logprob}` with one key per distinct token: a name already taken goes by
        `token_id:N` (see the module docstring)."""
        out: dict[str, float] = {}
        for token_id, logprob in alternatives:
            key = self.name(token_id)
            if key in out:
                key = f"token_id:{token_id}"
            out[key] = _clamp(logprob)
        return out


def check_prompt_logprobs(request) -> None:
    """vLLM's rule: `prompt_logprobs` come whole with the first token, so not in a stream."""
    if request.prompt_logprobs is not None and request.stream:
        raise bad_request("prompt_logprobs is not available with stream=true", param="prompt_logprobs")


def scores_or_502(scores: pb.PromptLogprobs | None) -> pb.PromptLogprobs:
    """The prompt scores the pods must have sent (a pod that ignores the field is not silently empty)."""
    if scores is None:
        raise upstream_error("the pods returned no prompt logprobs for a request that asked for them")
    return scores


def _clamp(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB


def _with_chosen(token_id: int, logprob: float, top: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The alternatives, and the chosen token after them unless it is one of them."""
    alternatives = list(top)
    if all(t != token_id for t, _ in alternatives):
        alternatives.append((token_id, logprob))
    return alternatives


def _top_of(lp: pb.TokenLogprobs) -> list[tuple[int, float]]:
    return [(t.token_id, t.logprob) for t in lp.top]


def prompt_entries(scores: pb.PromptLogprobs, num_top: int) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """(logprob, rank, `num_top` alternatives) of prompt tokens 1..n-1 from the packed message."""
    k = scores.num_top
    ids, values = scores.top_token_ids, scores.top_logprobs
    return [(lp, rank, list(zip(ids[i * k:i * k + num_top], values[i * k:i * k + num_top])))
            for i, (lp, rank) in enumerate(zip(scores.token_logprobs, scores.token_ranks))]


def completion_logprobs(names: TokenNames, token_ids: Sequence[int], logprobs: Sequence[pb.TokenLogprobs],
                        text_offset: int, prompt: tuple[Sequence[int], pb.PromptLogprobs, int] | None = None
                        ) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset. `prompt`
    (echo): (prompt token ids, their scores, alternatives per token) go first, the first prompt
    token with `null`s as OpenAI sends it."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if prompt is not None:
        prompt_ids, scores, num_top = prompt
        tokens.append(names.name(prompt_ids[0]))
        token_logprobs.append(None)
        tops.append(None)
        for token_id, (lp, _, top) in zip(prompt_ids[1:], prompt_entries(scores, num_top)):
            tokens.append(names.name(token_id))
            token_logprobs.append(_clamp(lp))
            tops.append(names.top_dict(_with_chosen(token_id, lp, top)))
    for token_id, lp in zip(token_ids, logprobs):
        tokens.append(names.name(token_id))
        token_logprobs.append(_clamp(lp.logprob))
        tops.append(names.top_dict(_with_chosen(token_id, lp.logprob, _top_of(lp))))
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(names: TokenNames, token_ids: Sequence[int], logprobs: Sequence[pb.TokenLogprobs]) -> dict[str, Any]:
    """The chat shape: one entry per token with its bytes and exactly `top_logprobs` alternatives."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": names.name(token_id), "logprob": _clamp(logprob), "bytes": names.bytes(token_id)}

    return {"content": [{**entry(token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in _top_of(lp)]}
                        for token_id, lp in zip(token_ids, logprobs)]}


def vllm_prompt_logprobs(names: TokenNames, prompt_ids: Sequence[int], scores: pb.PromptLogprobs,
                         num_top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: `null` for the first token, then per token a dict keyed by token
    id holding the token itself and its `num_top` most likely alternatives, each with its
    logprob, rank (1 = most likely) and decoded text."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token_id, (lp, rank, top) in zip(prompt_ids[1:], prompt_entries(scores, num_top)):
        entry = {str(token_id): {"logprob": _clamp(lp), "rank": rank, "decoded_token": names.name(token_id)}}
        for place, (alt_id, alt_lp) in enumerate(top, start=1):
            entry.setdefault(str(alt_id), {"logprob": _clamp(alt_lp), "rank": place,
                                           "decoded_token": names.name(alt_id)})
        out.append(entry)
    return out
