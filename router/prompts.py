"""Turning request bodies into prompt token ids, checked against the context length.

Tokenization runs in a worker thread (`asyncio.to_thread`): a 100k-character prompt takes tens of
milliseconds to encode, which on the event loop would stall every stream the router is serving.
All checks happen here, before any routing or RPC: a prompt that cannot fit is a 400, not a
failed request on a pod.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.tokenizer import Tokenizer, TokenizerError
from router.errors import bad_request
from router.protocol import ChatCompletionRequest, CompletionRequest

MAX_PROMPTS = 64   # prompts in one /v1/completions batch


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids and, when the client sent text, that text (for `echo`)."""

    token_ids: list[int]
    text: str | None = None


def _check_token_ids(ids: list[int], vocab_size: int) -> None:
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"token id {token_id} is out of range [0, {vocab_size})", param="prompt")


async def completion_prompts(request: CompletionRequest, tokenizer: Tokenizer) -> list[Prompt]:
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
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}", param="prompt")

    def encode_all() -> list[Prompt]:
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append(Prompt(tokenizer.encode(item), item))
            else:
                _check_token_ids(item, tokenizer.vocab_size)
                prompts.append(Prompt(list(item)))
        return prompts

    prompts = await asyncio.to_thread(encode_all)
    if any(not p.token_ids for p in prompts):
        raise bad_request("prompt must not be empty", param="prompt")
    return prompts


async def chat_prompt(request: ChatCompletionRequest, tokenizer: Tokenizer) -> Prompt:
    """The rendered chat template of a /v1/chat/completions body, tokenized."""
    messages = request.template_messages()

    def render() -> Prompt:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt)
        return Prompt(tokenizer.encode(text, add_special_tokens=False), text)

    try:
        prompt = await asyncio.to_thread(render)
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
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens; at least one token must be left for the completion.",
            param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for "
            f"the completion). Please reduce the length of the prompt or the completion.",
            param=max_tokens_param, code="context_length_exceeded")
    return max_tokens
