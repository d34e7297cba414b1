"""POST /v1/completions: one or more prompts (text or token ids), n choices each, optional echo;
output constraints as on chat (router/structured/), from the first token."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from router import responses as R
from router.errors import bad_request
from router.generation import ChoiceEvent, RequestRun
from router.prompts import check_context_length, completion_prompts
from router.protocol import CompletionRequest
from router.serving import (ServingState, StreamFormat, build_specs, check_common, execute, new_request_id,
                            parse_body, sampling_or_400)
from router.structured.plan import completion_spec
from router.structured.surface import requested_constraint


async def create_completion(state: ServingState, http: Request) -> Response:
    arrival = time.monotonic()
    request = await parse_body(http, CompletionRequest, state.config.max_request_body_bytes)
    lora = check_common(state, request)
    if request.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of must equal n (best-of sampling is not supported)", param="best_of")
    if request.echo and request.logprobs is not None:
        raise bad_request("echo with logprobs is not supported (no prompt logprobs)", param="echo")
    sampling_or_400(lambda: request.sampling_params(default_max_tokens=1))   # types and ranges first
    constraint = requested_constraint(request)
    structured = None
    if constraint is not None:
        structured = await state.encoder.run(lambda: completion_spec(state.output, constraint))
    max_len = state.max_model_len()
    prompts = await completion_prompts(request, state.encoder, max_len)
    params = []
    for prompt in prompts:
        max_tokens = check_context_length(len(prompt.token_ids), request.max_tokens, max_len, "prompt", "max_tokens")
        sampling = sampling_or_400(lambda: request.sampling_params(default_max_tokens=max_tokens))
        params.append(replace(sampling, structured=structured) if structured is not None else sampling)
    request_id, created, model = new_request_id("cmpl"), int(time.time()), lora or state.config.model_name
    specs = build_specs(state, http, request_id, prompts, request.n, params, request.priority, lora)
    num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
    tokenizer = state.tokenizer

    def echo_text(index: int) -> str:
        prompt = prompts[index // request.n]
        return (prompt.text if prompt.text is not None else tokenizer.decode(prompt.token_ids)) if request.echo else ""

    def whole(results: list[R.ChoiceResult], run: RequestRun) -> dict[str, Any]:
        choices = []
        for i, result in enumerate(results):
            prefix = echo_text(i)
            logprobs = (R.completion_logprobs(tokenizer, result.token_ids[:len(result.logprobs)], result.logprobs,
                                              len(prefix)) if request.logprobs is not None else None)
            choices.append({"index": i, "text": prefix + result.text, "logprobs": logprobs,
                            "finish_reason": result.finish_reason})
        return R.completion_body(request_id, created, model, choices,
                                 R.usage(num_prompt_tokens, sum(run.num_output_tokens)))

    def stream_format() -> StreamFormat:
        include_usage = request.wants_usage_in_stream()

        def body(choice: dict[str, Any]) -> dict[str, Any]:
            chunk = R.completion_body(request_id, created, model, [choice], None)
            if not include_usage:
                chunk.pop("usage")
            return chunk

        texts = [R.sse_template(body({"index": i, "text": R.TEXT, "logprobs": None, "finish_reason": None}))
                 for i in range(len(specs))]
        offsets = [len(echo_text(i)) if request.echo else 0 for i in range(len(specs))]   # text_offset

        def chunk(event: ChoiceEvent) -> str:
            logprobs = None
            if request.logprobs is not None:
                logprobs = R.completion_logprobs(tokenizer, event.token_ids[:len(event.logprobs)], event.logprobs,
                                                 offsets[event.index])
                offsets[event.index] += len(event.text)
            elif event.finish_reason is None:
                return texts[event.index](event.text)
            return R.sse(body({"index": event.index, "text": event.text, "logprobs": logprobs,
                               "finish_reason": event.finish_reason}))

        def tail(run: RequestRun) -> str:
            usage = R.usage(num_prompt_tokens, sum(run.num_output_tokens))
            return (R.sse(R.completion_body(request_id, created, model, [], usage)) if include_usage
                    else "") + R.sse("[DONE]")

        head = "".join(R.sse(R.completion_body(request_id, created, model, [
            {"index": i, "text": echo_text(i), "logprobs": None, "finish_reason": None}], None))
            for i in range(len(specs))) if request.echo else ""
        return StreamFormat(head, chunk, tail)

    return await execute(state, http, arrival, specs, request.stream, whole, stream_format)
