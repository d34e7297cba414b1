"""POST /v1/responses: validate, render the conversation with the chat template, run it on the pods
as one sequence (the same dispatch as chat), answer as a Response object or its typed events."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from router import responses as R
from router.generation import ChoiceEvent, RequestRun
from router.logprobs import TokenNames, chat_logprobs
from router.prompts import chat_prompt, check_context_length
from router.responses_api.events import ResponseBuilder, new_id, usage
from router.responses_api.protocol import ResponsesRequest
from router.serving import (ServingState, StreamFormat, build_specs, check_common, execute, parse_body,
                            sampling_or_400)

# SamplingParams' names for the fields this API spells differently.
_RENAME = {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}


class _Conversation:
    """What `router.prompts.chat_prompt` reads from a chat body, for the Responses API's messages."""

    add_generation_prompt = True

    def __init__(self, messages: list[dict[str, str]]) -> None:
        self._messages = messages

    def template_messages(self) -> list[dict[str, str]]:
        return self._messages


def _echoed(request: ResponsesRequest, model: str) -> dict[str, Any]:
    """What a Response repeats from its request."""
    fmt = request.text.format.model_dump(by_alias=True, exclude_none=True) if request.text else {"type": "text"}
    return {"model": model, "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature, "top_p": request.top_p, "top_logprobs": request.top_logprobs,
            "parallel_tool_calls": True if request.parallel_tool_calls is None else request.parallel_tool_calls,
            "tool_choice": request.tool_choice or "auto", "tools": [], "metadata": request.metadata or {},
            "text": {"format": fmt}, "truncation": "disabled", "store": False, "background": False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "user": request.user}


async def create_response(state: ServingState, http: Request) -> Response:
    arrival = time.monotonic()
    request = await parse_body(http, ResponsesRequest, state.config.max_request_body_bytes)
    check_common(state, request)
    request.check_supported()
    sampling_or_400(lambda: request.sampling_params(default_max_tokens=1), _RENAME)   # types and ranges first
    max_len = state.max_model_len()
    prompt = await chat_prompt(_Conversation(request.messages()), state.encoder, max_len)
    max_tokens = check_context_length(len(prompt.token_ids), request.max_output_tokens, max_len, "input",
                                      "max_output_tokens")
    params = sampling_or_400(lambda: request.sampling_params(default_max_tokens=max_tokens), _RENAME)
    response_id = new_id("resp")
    specs = build_specs(state, http, response_id, [prompt], 1, [params], request.priority)
    names = TokenNames(state.tokenizer, request.return_tokens_as_token_ids)
    builder = ResponseBuilder(response_id, int(time.time()), _echoed(request, state.config.model_name))

    def logprobs_of(token_ids, logprobs) -> list | None:
        return chat_logprobs(names, token_ids, logprobs)["content"] if request.wants_logprobs else None

    def usage_of(run: RequestRun) -> dict[str, Any]:
        return usage(len(prompt.token_ids), run.choices[0].trace.num_cached_tokens, sum(run.num_output_tokens))

    def whole(results: list[R.ChoiceResult], run: RequestRun) -> dict[str, Any]:
        (result,) = results
        return builder.final(result.text, logprobs_of(result.token_ids, result.logprobs), result.finish_reason,
                             usage_of(run))

    def stream_format() -> StreamFormat:
        texts: list[str] = []
        logprobs: list = []
        finish: list[str | None] = [None]

        def chunk(event: ChoiceEvent) -> str:
            entries = logprobs_of(event.token_ids, event.logprobs)
            texts.append(event.text)
            logprobs.extend(entries or ())
            finish[0] = event.finish_reason or finish[0]
            return builder.delta(event.text, entries) if event.text or entries else ""

        def tail(run: RequestRun) -> str:
            final = builder.final("".join(texts), logprobs if request.wants_logprobs else None, finish[0],
                                  usage_of(run))
            return builder.tail(final)

        return StreamFormat(builder.head(), chunk, tail, builder.error)

    return await execute(state, http, arrival, specs, request.stream, whole, stream_format)
