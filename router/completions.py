"""POST /v1/completions: one or more prompts (text or token ids), n choices each, optional echo;
output constraints as on chat (router/structured/), from the first token.

Scoring a prompt, as evaluation harnesses do: `echo` with `logprobs` returns the prompt's tokens
with their logprobs before the completion's (the first token's `null`: nothing precedes it), and
`max_tokens: 0` with `echo` returns only the prompt (one token is sampled and dropped, as vLLM
does, so the pods run their usual prefill). vLLM's `prompt_logprobs` adds its own per-token dicts.
The pod that runs the prompt computes the scores (`engine.prompt_logprobs`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from router import responses as R
from router.errors import bad_request
from router.generation import ChoiceEvent, RequestRun
from router.logprobs import (TokenNames, check_prompt_logprobs, completion_logprobs, scores_or_502,
                             vllm_prompt_logprobs)
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
    if request.max_tokens == 0 and not request.echo:
        raise bad_request("max_tokens: must be >= 1 (0 only with echo, to score the prompt)", param="max_tokens")
    check_prompt_logprobs(request)
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
    names = TokenNames(tokenizer, request.return_tokens_as_token_ids)
    scores_only, n = request.scores_only, request.n
    echo_logprobs = request.echo and request.logprobs is not None

    def echo_text(index: int) -> str:
        prompt = prompts[index // n]
        return (prompt.text if prompt.text is not None else tokenizer.decode(prompt.token_ids)) if request.echo else ""

    def logprobs_of(index: int, token_ids, logprobs, prompt_scores, text_offset: int) -> dict[str, Any] | None:
        if request.logprobs is None:
            return None
        if scores_only:
            token_ids, logprobs = (), ()
        prompt = None
        if echo_logprobs:
            prompt, text_offset = (prompts[index // n].token_ids, scores_or_502(prompt_scores), request.logprobs), 0
        return completion_logprobs(names, token_ids[:len(logprobs)], logprobs, text_offset, prompt)

    def whole(results: list[R.ChoiceResult], run: RequestRun) -> dict[str, Any]:
        choices = []
        for i, result in enumerate(results):
            prefix = echo_text(i)
            logprobs = logprobs_of(i, result.token_ids, result.logprobs, result.prompt_logprobs, len(prefix))
            choice = {"index": i, "text": prefix if scores_only else prefix + result.text, "logprobs": logprobs,
                      "finish_reason": "length" if scores_only else result.finish_reason}
            if request.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(names, prompts[i // n].token_ids,
                                                                 scores_or_502(result.prompt_logprobs),
                                                                 request.prompt_logprobs)
            choices.append(choice)
        completion_tokens = 0 if scores_only else sum(run.num_output_tokens)
        return R.completion_body(request_id, created, model, choices, R.usage(num_prompt_tokens, completion_tokens))

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
        echo_pending = [echo_logprobs] * len(specs)   # its prompt's logprobs come with its first event

        def echo_chunk(event: ChoiceEvent) -> str:
            echo_pending[event.index] = False
            logprobs = logprobs_of(event.index, (), (), event.prompt_logprobs, 0)
            tokens = logprobs["tokens"]
            offsets[event.index] = logprobs["text_offset"][-1] + len(tokens[-1])
            return R.sse(body({"index": event.index, "text": echo_text(event.index), "logprobs": logprobs,
                               "finish_reason": None}))

        def chunk(event: ChoiceEvent) -> str:
            head = echo_chunk(event) if echo_pending[event.index] else ""
            if scores_only:
                return head + R.sse(body({"index": event.index, "text": "", "logprobs": None,
                                          "finish_reason": "length" if event.finish_reason else None}))
            logprobs = None
            if request.logprobs is not None:
                logprobs = completion_logprobs(names, event.token_ids[:len(event.logprobs)], event.logprobs,
                                               offsets[event.index])
                offsets[event.index] += len(event.text)
            elif event.finish_reason is None:
                return head + texts[event.index](event.text)
            return head + R.sse(body({"index": event.index, "text": event.text, "logprobs": logprobs,
                                      "finish_reason": event.finish_reason}))

        def tail(run: RequestRun) -> str:
            usage = R.usage(num_prompt_tokens, 0 if scores_only else sum(run.num_output_tokens))
            return (R.sse(R.completion_body(request_id, created, model, [], usage)) if include_usage
                    else "") + R.sse("[DONE]")

        head = "".join(R.sse(R.completion_body(request_id, created, model, [
            {"index": i, "text": echo_text(i), "logprobs": None, "finish_reason": None}], None))
            for i in range(len(specs))) if request.echo and not echo_logprobs else ""
        return StreamFormat(head, chunk, tail)

    return await execute(state, http, arrival, specs, request.stream, whole, stream_format)
