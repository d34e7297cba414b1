"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, in vLLM's shapes, answered by the
router itself: it holds the tokenizer and the chat template the pods' prompts are made with, so no
pod is asked and the answer is exactly what a completion or chat request would send.

- `/tokenize` takes vLLM's `TokenizeCompletionRequest` (`prompt`, `add_special_tokens` default
  true) or `TokenizeChatRequest` (`messages` through the chat template, `add_generation_prompt`
  default true, `continue_final_message`, `tools`, `add_special_tokens` default false), and
  `return_token_strs` (the vocabulary pieces, as `convert_ids_to_tokens`). It answers
  `{count, max_model_len, tokens, token_strs}`. A text longer than the context is still counted:
  counting is what a client asks this for.
- `/detokenize` takes `{tokens}` and answers `{prompt}` (special tokens kept, as transformers'
  `decode` does by default).
- `/tokenizer_info` (only with `--enable-tokenizer-info-endpoint`, as in vLLM: it shows the chat
  template) answers the tokenizer's configuration; lm-evaluation-harness's remote tokenizer reads
  its `eos_token`, `bos_token` and `chat_template`.

The same API key as `/v1` guards them (the app adds the check); bodies are bounded like every other.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Request
from pydantic import Field

from engine.tokenizer import ChatTemplateError, Tokenizer, TokenizerError
from router.errors import bad_request
from router.protocol import (MAX_MESSAGES, MAX_PROMPT_TOKEN_IDS, MAX_TOOLS, ChatCompletionRequest, ChatMessage,
                             _capped, _Strict)
from router.serving import ServingState, check_model, parse_body


class TokenizeRequest(_Strict):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`), as one body."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], _capped(MAX_MESSAGES, min_length=1)] | None = None
    add_special_tokens: bool | None = None      # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    tools: Annotated[list[dict[str, Any]], _capped(MAX_TOOLS)] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    template_messages = ChatCompletionRequest.template_messages   # the chat endpoint's rendering of messages


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: Annotated[list[int], _capped(MAX_PROMPT_TOKEN_IDS)] = Field(...)


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None) -> str:
    """The chat template's text; `continue_final_message` ends it right after the final message's
    content, so the model continues that message (transformers' rule: cut at the content's last
    occurrence)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    if continue_final_message:
        final = str(messages[-1].get("content") or "").strip()
        cut = text.rfind(final) if final else -1
        if cut < 0:
            raise ChatTemplateError("continue_final_message: the final message's content is not in the rendered "
                                    "prompt")
        text = text[:cut + len(final)]
    return text


async def tokenize(state: ServingState, http: Request) -> dict[str, Any]:
    request = await parse_body(http, TokenizeRequest, state.config.max_request_body_bytes)
    check_model(state, request.model)
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    if request.chat_template is not None:
        raise bad_request("chat_template is not supported: the model's own template renders messages",
                          param="chat_template")
    if request.chat_template_kwargs:
        raise bad_request("chat_template_kwargs is not supported", param="chat_template_kwargs")
    if request.continue_final_message and request.add_generation_prompt and request.messages is not None:
        raise bad_request("Cannot set both continue_final_message and add_generation_prompt to true",
                          param="continue_final_message")
    tokenizer = state.tokenizer
    chat = request.messages is not None
    add_special = request.add_special_tokens if request.add_special_tokens is not None else not chat

    def work() -> list[int]:
        text = request.prompt
        if chat:
            text = render_chat(tokenizer, request.template_messages(), request.add_generation_prompt,
                               request.continue_final_message, request.tools)
        return tokenizer.encode(text, add_special_tokens=add_special)

    try:
        ids = await state.encoder.run(work)
    except TokenizerError as exc:
        raise bad_request(str(exc), param="messages") from None
    strs = [s if s is not None else "" for s in tokenizer.convert_ids_to_tokens(ids)] if request.return_token_strs \
        else None
    return {"count": len(ids), "max_model_len": state.max_model_len(), "tokens": ids, "token_strs": strs}


async def detokenize(state: ServingState, http: Request) -> dict[str, Any]:
    request = await parse_body(http, DetokenizeRequest, state.config.max_request_body_bytes)
    check_model(state, request.model)
    vocab_size = state.tokenizer.vocab_size
    for token_id in request.tokens:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"tokens: token id {token_id} is out of range [0, {vocab_size})", param="tokens")
    text = await state.encoder.run(lambda: state.tokenizer.decode(request.tokens, skip_special_tokens=False))
    return {"prompt": text}


def tokenizer_info(state: ServingState) -> dict[str, Any]:
    """vLLM's TokenizerInfoResponse: the tokenizer's configuration, as transformers saves it."""
    tokenizer = state.tokenizer
    info: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens,
                            "additional_special_tokens": list(tokenizer.extra_special_tokens),
                            "chat_template": tokenizer.chat_template, "model_max_length": tokenizer.model_max_length}
    for name in ("add_bos_token", "add_eos_token"):
        if getattr(tokenizer, name) is not None:
            info[name] = getattr(tokenizer, name)
    return info
