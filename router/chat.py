"""POST /v1/chat/completions: messages rendered with the model's chat template, n choices.

Tools, output constraints and reasoning (router/structured/plan.py) are checked before anything
is routed; a choice's text then goes through its `ChoiceOutput` (reasoning, content, tool calls)
when the request needs one, else straight into `content`.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from router import responses as R
from router.chat_output import ChoiceOutput
from router.errors import bad_request
from router.generation import ChoiceEvent, RequestRun
from router.logprobs import TokenNames, chat_logprobs, check_prompt_logprobs, scores_or_502, vllm_prompt_logprobs
from router.prompts import chat_prompt, check_context_length
from router.protocol import ChatCompletionRequest
from router.serving import (ServingState, StreamFormat, build_specs, check_common, execute, new_request_id,
                            parse_body, sampling_or_400)
from router.structured.plan import plan_output, with_plan
from router.structured.surface import requested_constraint
from router.tools.request import template_tools


async def create_chat_completion(state: ServingState, http: Request) -> Response:
    arrival = time.monotonic()
    request = await parse_body(http, ChatCompletionRequest, state.config.max_request_body_bytes)
    lora = check_common(state, request)
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    check_prompt_logprobs(request)
    max_tokens_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    rename = {"logprobs": "top_logprobs", "max_tokens": max_tokens_param}
    sampling_or_400(lambda: request.sampling_params(default_max_tokens=1), rename)
    features = state.output
    constraint = requested_constraint(request)
    tools = None
    if request.tools is not None or request.functions is not None or request.tool_choice is not None \
            or request.function_call is not None:
        tools = await state.encoder.run(lambda: features.tool_request(request))
    max_len = state.max_model_len()
    prompt = await chat_prompt(request, state.encoder, max_len,
                               tools=template_tools(tools, features.exclude_tools_when_tool_choice_none))
    max_tokens = check_context_length(len(prompt.token_ids), request.requested_max_tokens(), max_len,
                                      "messages", max_tokens_param)
    plan = await plan_output(state.encoder, features, constraint, tools, prompt.text)
    params = with_plan(sampling_or_400(lambda: request.sampling_params(default_max_tokens=max_tokens), rename), plan)
    request_id, created, model = new_request_id("chatcmpl"), int(time.time()), lora or state.config.model_name
    specs = build_specs(state, http, request_id, [prompt], request.n, [params], request.priority, lora)
    names = TokenNames(state.tokenizer, request.return_tokens_as_token_ids)
    output_spec = plan.output

    def logprobs_of(token_ids, logprobs) -> dict[str, Any] | None:
        return chat_logprobs(names, token_ids, logprobs) if request.logprobs else None

    def whole(results: list[R.ChoiceResult], run: RequestRun) -> dict[str, Any]:
        choices = []
        for i, result in enumerate(results):
            message, finish_reason = {"role": "assistant", "content": result.text}, result.finish_reason
            if output_spec.active:
                output = ChoiceOutput(output_spec)
                output.feed(result.text)
                output.finish()
                message, finish_reason = output.message(), output.finish_reason(finish_reason)
            choices.append({"index": i, "message": message, "logprobs": logprobs_of(result.token_ids, result.logprobs),
                            "finish_reason": finish_reason})
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
        outputs = [ChoiceOutput(output_spec) for _ in specs] if output_spec.active else []

        def chunk(event: ChoiceEvent) -> str:
            if outputs:
                return _output_chunks(outputs[event.index], event, body, logprobs_of(event.token_ids, event.logprobs))
            if event.finish_reason is None and not request.logprobs:
                return deltas[event.index](event.text)
            return R.sse(body([_chat_delta(names, event, request.logprobs)]))

        def tail(run: RequestRun) -> str:
            usage = R.usage(len(prompt.token_ids), sum(run.num_output_tokens))
            return (R.sse(R.chat_body(request_id, created, model, [], usage, chunk=True)) if include_usage
                    else "") + R.sse("[DONE]")

        # With a ChoiceOutput the content may stay null (only calls, only reasoning): no "" to start it.
        role = {"role": "assistant"} if outputs else {"role": "assistant", "content": ""}
        head = "".join(R.sse(body([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}]))
                       for i in range(len(specs)))
        return StreamFormat(head, chunk, tail)

    return await execute(state, http, arrival, specs, request.stream, whole, stream_format)


def _chat_delta(names: TokenNames, event: ChoiceEvent, logprobs: bool) -> dict[str, Any]:
    delta = {"content": event.text} if event.text or event.finish_reason is None else {}
    return {"index": event.index, "delta": delta,
            "logprobs": chat_logprobs(names, event.token_ids, event.logprobs) if logprobs else None,
            "finish_reason": event.finish_reason}


def _output_chunks(output: ChoiceOutput, event: ChoiceEvent, body, logprobs: dict[str, Any] | None) -> str:
    """The SSE chunks of one pod message through a `ChoiceOutput`: one per delta (the message's
    logprobs on the first), the finish reason on the last; a message that decides nothing yet
    sends only its logprobs, if asked for."""
    deltas = output.feed(event.text)
    if event.finish_reason is not None:
        deltas += output.finish()
    if not deltas and (event.finish_reason is not None or logprobs is not None):
        deltas = [{}]
    chunks = []
    for j, delta in enumerate(deltas):
        last = j == len(deltas) - 1
        finish = output.finish_reason(event.finish_reason) if last and event.finish_reason is not None else None
        chunks.append(R.sse(body([{"index": event.index, "delta": delta, "logprobs": logprobs if j == 0 else None,
                                   "finish_reason": finish}])))
    return "".join(chunks)
