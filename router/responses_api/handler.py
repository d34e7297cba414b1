"""POST /v1/responses: validate, render the conversation with the chat template (tools included),
run it on the pods as one sequence (the same dispatch as chat), read the text as chat reads it
(`ChoiceOutput`: reasoning, content, tool calls) and answer as a Response object or its typed
events (`events.OutputItems`). `text.format` and `tool_choice` become the same constraint and
forcing grammars as chat's `response_format` and `tool_choice` (router/structured/plan.py)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from router import responses as R
from router.chat_output import ChoiceOutput
from router.generation import ChoiceEvent, RequestRun
from router.logprobs import TokenNames, chat_logprobs
from router.prompts import chat_prompt, check_context_length
from router.protocol import ChatMessage
from router.responses_api.events import OutputItems, ResponseBuilder, new_id, usage
from router.responses_api.protocol import ResponsesRequest
from router.serving import (ServingState, StreamFormat, build_specs, check_common, execute, parse_body,
                            sampling_or_400)
from router.structured.plan import plan_output, with_plan
from router.tools.messages import template_message
from router.tools.request import template_tools

# SamplingParams' names for the fields this API spells differently.
_RENAME = {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}


class _Conversation:
    """What `router.prompts.chat_prompt` reads from a chat body, for the Responses API's messages."""

    add_generation_prompt = True
    chat_template_kwargs = None

    def __init__(self, messages: list[ChatMessage]) -> None:
        self._messages = messages

    def template_messages(self) -> list[dict[str, Any]]:
        return [template_message(message) for message in self._messages]


def _echoed(request: ResponsesRequest, model: str) -> dict[str, Any]:
    """What a Response repeats from its request."""
    fmt = request.text.format.model_dump(by_alias=True, exclude_none=True) if request.text else {"type": "text"}
    return {"model": model, "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature, "top_p": request.top_p, "top_logprobs": request.top_logprobs,
            "parallel_tool_calls": True if request.parallel_tool_calls is None else request.parallel_tool_calls,
            "tool_choice": request.tool_choice or "auto", "tools": request.tools or [], "metadata": request.metadata or {},
            "text": {"format": fmt}, "truncation": "disabled", "store": False, "background": False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "user": request.user}


async def create_response(state: ServingState, http: Request) -> Response:
    arrival = time.monotonic()
    request = await parse_body(http, ResponsesRequest, state.config.max_request_body_bytes)
    lora = check_common(state, request)     # the adapter `model` names, or None (the base model)
    request.check_supported()
    sampling_or_400(lambda: request.sampling_params(default_max_tokens=1), _RENAME)   # types and ranges first
    features = state.output
    constraint = request.constraint()
    messages = request.messages()
    tools = None
    if request.asks_for_tools:
        fields = request.tool_fields()
        tools = await state.encoder.run(lambda: features.tool_request(fields, flat=True))
    max_len = state.max_model_len()
    prompt = await chat_prompt(_Conversation(messages), state.encoder, max_len,
                               tools=template_tools(tools, features.exclude_tools_when_tool_choice_none))
    max_tokens = check_context_length(len(prompt.token_ids), request.max_output_tokens, max_len, "input",
                                      "max_output_tokens")
    plan = await plan_output(state.encoder, features, constraint, tools, prompt.text)
    params = with_plan(sampling_or_400(lambda: request.sampling_params(default_max_tokens=max_tokens), _RENAME),
                       plan)
    response_id = new_id("resp")
    specs = build_specs(state, http, response_id, [prompt], 1, [params], request.priority, lora)
    names = TokenNames(state.tokenizer, request.return_tokens_as_token_ids)
    builder = ResponseBuilder(response_id, int(time.time()), _echoed(request, lora or state.config.model_name))
    output_spec = plan.output

    def logprobs_of(token_ids, logprobs) -> list | None:
        return chat_logprobs(names, token_ids, logprobs)["content"] if request.wants_logprobs else None

    def items() -> tuple[OutputItems, ChoiceOutput | None]:
        return OutputItems(builder, request.wants_logprobs), ChoiceOutput(output_spec) if output_spec.active else None

    def feed(output: OutputItems, reader: ChoiceOutput | None, text: str, logprobs: list | None,
             finished: bool) -> str:
        """One pod message's text (and entries) through the reader, into the items; its events."""
        if reader is None:
            deltas = [{"content": text}] if text or logprobs else []
        else:
            deltas = reader.feed(text) + (reader.finish() if finished else [])
        if not deltas and logprobs:
            deltas = [{}]
        return "".join(output.add(delta, logprobs if i == 0 else None) for i, delta in enumerate(deltas))

    def final(output: OutputItems, finish_reason: str | None, run: RequestRun) -> tuple[str, dict[str, Any]]:
        status = "incomplete" if finish_reason == "length" else "completed"
        events = output.close(status)
        usage_ = usage(len(prompt.token_ids), run.choices[0].trace.num_cached_tokens, sum(run.num_output_tokens))
        return events, builder.response(status, output.items, usage_)

    def whole(results: list[R.ChoiceResult], run: RequestRun) -> dict[str, Any]:
        (result,) = results
        output, reader = items()
        feed(output, reader, result.text, logprobs_of(result.token_ids, result.logprobs), True)
        return final(output, result.finish_reason, run)[1]

    def stream_format() -> StreamFormat:
        output, reader = items()
        finish: list[str | None] = [None]

        def chunk(event: ChoiceEvent) -> str:
            finish[0] = event.finish_reason or finish[0]
            return feed(output, reader, event.text, logprobs_of(event.token_ids, event.logprobs),
                        event.finish_reason is not None)

        def tail(run: RequestRun) -> str:
            events, response = final(output, finish[0], run)
            return events + builder.tail(response)

        return StreamFormat(builder.head(), chunk, tail, builder.error)

    return await execute(state, http, arrival, specs, request.stream, whole, stream_format)
