"""Turning request bodies into prompt token ids, checked against the context length.

The work is bounded before it starts. A text longer than `max_model_len * max_chars_per_token`
characters cannot fit the context (`Tokenizer.max_chars_per_token`: no token covers more input
characters than that), so it is refused from its length alone; a 10 MB prompt used to be encoded
first, for seconds, holding the GIL. A token-id prompt is checked for length before its ids.
What is left is tokenized in a small pool of worker threads (`PromptEncoder`), with the GIL
released (`Tokenizer.encode`), so a long prompt delays only its own request, never `/health` or
another stream, and a burst of them costs at most `NUM_TOKENIZER_THREADS` cores.
All checks happen here, before any routing or RPC: a prompt that cannot fit is a 400, not a
failed request on a pod.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from engine.tokenizer import Tokenizer, TokenizerError
from router.errors import APIError, bad_request
from router.protocol import ChatCompletionRequest, CompletionRequest

NUM_TOKENIZER_THREADS = 2
# Template variables the request sets through its own fields.
_RESERVED_TEMPLATE_VARIABLES = {"messages", "tools", "documents", "add_generation_prompt"}
T = TypeVar("T")


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids and, when the client sent text, that text (for `echo`)."""

    token_ids: list[int]
    text: str | None = None


class PromptEncoder:
    """The tokenizer behind a bounded pool of threads; one per app (`close` at shutdown)."""

    def __init__(self, tokenizer: Tokenizer, num_threads: int = NUM_TOKENIZER_THREADS) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenize")

    def max_prompt_chars(self, max_model_len: int) -> int:
        """The longest text that could still be fewer than `max_model_len` tokens."""
        return max_model_len * self.tokenizer.max_chars_per_token

    async def run(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def too_long(max_model_len: int, what: str, param: str) -> APIError:
    return bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your {what}; "
                       f"at least one token must be left for the completion.",
                       param=param, code="context_length_exceeded")


def _check_chars(text_length: int, encoder: PromptEncoder, max_model_len: int, param: str) -> None:
    limit = encoder.max_prompt_chars(max_model_len)
    if text_length > limit:
        per_token = encoder.tokenizer.max_chars_per_token
        raise too_long(max_model_len, f"prompt has {text_length} characters, and {max_model_len} tokens of at "
                       f"most {per_token} characters each hold at most {limit}", param)


def _check_token_ids(ids: list[int], vocab_size: int) -> None:
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"token id {token_id} is out of range [0, {vocab_size})", param="prompt")


async def completion_prompts(request: CompletionRequest, encoder: PromptEncoder, max_model_len: int) -> list[Prompt]:
    """The prompts of a /v1/completions body: a string, strings, token ids, or lists of ids."""
    raw = request.prompt
    if isinstance(raw, str):
        items: list[str | list[int]] = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [list(raw)]          # one prompt given as token ids
    else:
        items = list(raw)            # several prompts (strings or id lists)
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    for item in items:               # bounds first: nothing is tokenized for a prompt that cannot fit
        if isinstance(item, str):
            _check_chars(len(item), encoder, max_model_len, "prompt")
        elif len(item) >= max_model_len:
            raise too_long(max_model_len, f"prompt has {len(item)} tokens", "prompt")
    tokenizer = encoder.tokenizer

    def encode_all() -> list[Prompt]:
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append(Prompt(tokenizer.encode(item), item))
            else:
                _check_token_ids(item, tokenizer.vocab_size)
                prompts.append(Prompt(list(item)))
        return prompts

    prompts = await encoder.run(encode_all)
    if any(not p.token_ids for p in prompts):
        raise bad_request("prompt must not be empty", param="prompt")
    return prompts


async def chat_prompt(request: ChatCompletionRequest, encoder: PromptEncoder, max_model_len: int,
                      tools: list[dict] | None = None) -> Prompt:
    """The rendered chat template of a /v1/chat/completions body (with `tools` for the template), tokenized."""
    messages = request.template_messages()
    # The rendered text holds every message's text, so their sum bounds it from below.
    _check_chars(sum(len(m["content"] or "") for m in messages), encoder, max_model_len, "messages")
    tokenizer = encoder.tokenizer
    template_kwargs = request.chat_template_kwargs or {}
    reserved = sorted(set(template_kwargs) & _RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")

    def render() -> Prompt:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt,
                                             tools=tools, **template_kwargs)
        _check_chars(len(text), encoder, max_model_len, "messages")
        return Prompt(tokenizer.encode(text, add_special_tokens=False), text)

    try:
        prompt = await encoder.run(render)
    except TokenizerError as exc:
        raise bad_request(str(exc), param="messages") from None
    if not prompt.token_ids:
        raise bad_request("messages render to an empty prompt", param="messages")
    return prompt


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                         prompt_param: str, max_tokens_param: str) -> int:
    """The max_tokens to use; raises 400 when prompt + max_tokens exceeds the context length.

    `max_tokens` None means "as many as fit" (chat without a limit, as vLLM does).
    """
    if num_prompt_tokens >= max_model_len:
        raise too_long(max_model_len, f"prompt has {num_prompt_tokens} tokens", prompt_param)
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for "
            f"the completion). Please reduce the length of the prompt or the completion.",
            param=max_tokens_param, code="context_length_exceeded")
    return max_tokens
