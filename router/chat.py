"""POST /v1/chat/completions: messages rendered with the model's chat template, n choices."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from router import responses as R
from router.errors import bad_request
from router.generation import ChoiceEvent, RequestRun
from router.logprobs import TokenNames, chat_logprobs, check_prompt_logprobs, scores_or_502, vllm_prompt_logprobs
from router.prompts import chat_prompt, check_context_length
from router.protocol import ChatCompletionRequest
from router.serving import (ServingState, StreamFormat, build_specs, check_common, execute, new_request_id,
                            parse_body, sampling_or_400)


async def create_chat_completion(state: ServingState, http: Request) -> Response:
    arrival = time.monotonic()
    request = await parse_body(http, ChatCompletionRequest, state.config.max_request_body_bytes)
    check_common(state, request)
    if request.tools:
        raise bad_request("tools are not supported", param="tools")
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    check_prompt_logprobs(request)
    max_tokens_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    rename = {"logprobs": "top_logprobs", "max_tokens": max_tokens_param}
    sampling_or_400(lambda: request.sampling_params(default_max_tokens=1), rename)
    max_len = state.max_model_len()
    prompt = await chat_prompt(request, state.encoder, max_len)
    max_tokens = check_context_length(len(prompt.token_ids), request.requested_max_tokens(), max_len,
                                      "messages", max_tokens_param)
    params = sampling_or_400(lambda: request.sampling_params(default_max_tokens=max_tokens), rename)
    request_id, created, model = new_request_id("chatcmpl"), int(time.time()), state.config.model_name
    specs = build_specs(state, http, request_id, [prompt], request.n, [params], request.priority)
    names = TokenNames(state.tokenizer, request.return_tokens_as_token_ids)

    def whole(results: list[R.ChoiceResult], run: RequestRun) -> dict[str, Any]:
        choices = [{"index": i, "message": {"role": "assistant", "content": result.text},
                    "logprobs": chat_logprobs(names, result.token_ids, result.logprobs) if request.logprobs else None,
                    "finish_reason": result.finish_reason} for i, result in enumerate(results)]
        body = R.chat_body(request_id, created, model, choices,
                           R.usage(len(prompt.token_ids), sum(run.num_output_tokens)), chunk=False)
        if request.prompt_logprobs is not None:   # vLLM: one list per response (every choice has the prompt)
            body["prompt_logprobs"] = vllm_prompt_logprobs(names, prompt.token_ids, scores_or_502(
                results[0].prompt_logprobs), request.prompt_logprobs)
        return body

    def stream_format() -> StreamFormat:
        include_usage = request.wants_usage_in_stream()

        def body(choices: list[dict[str, Any]]) -> dict[str, Any]:
            chunk = R.chat_body(request_id, created, model, choices, None, chunk=True)
            if not include_usage:
                chunk.pop("usage")
            return chunk

        deltas = [R.sse_template(body([{"index": i, "delta": {"content": R.TEXT}, "logprobs": None,
                                        "finish_reason": None}])) for i in range(len(specs))]

        def chunk(event: ChoiceEvent) -> str:
            if event.finish_reason is None and not request.logprobs:
                return deltas[event.index](event.text)
            return R.sse(body([_chat_delta(names, event, request.logprobs)]))

        def tail(run: RequestRun) -> str:
            usage = R.usage(len(prompt.token_ids), sum(run.num_output_tokens))
            return (R.sse(R.chat_body(request_id, created, model, [], usage, chunk=True)) if include_usage
                    else "") + R.sse("[DONE]")

        head = "".join(R.sse(body([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}])) for i in range(len(specs)))
        return StreamFormat(head, chunk, tail)

    return await execute(state, http, arrival, specs, request.stream, whole, stream_format)


def _chat_delta(names: TokenNames, event: ChoiceEvent, logprobs: bool) -> dict[str, Any]:
    delta = {"content": event.text} if event.text or event.finish_reason is None else {}
    return {"index": event.index, "delta": delta,
            "logprobs": chat_logprobs(names, event.token_ids, event.logprobs) if logprobs else None,
            "finish_reason": event.finish_reason}
