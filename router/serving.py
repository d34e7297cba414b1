"""The /v1/completions and /v1/chat/completions handlers: validate, tokenize, run, respond.

Order matters: the body is parsed and every parameter, the model name and the context length are
checked before anything is routed, so a bad request never reaches a pod. A streaming response
starts only after every choice has been admitted and has its first token (`RequestRun.prime`), so
429/503 arrive as real statuses; after that, errors travel as an SSE `error` event. A client that
goes away cancels the run, which cancels the pod calls.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.tokenizer import Tokenizer
from router.config import RouterConfig
from router.dispatch import Dispatcher, SequenceSpec
from router.errors import APIError, bad_request, not_found
from router.generation import ChoiceEvent, RequestRun
from router.metrics import RouterMetrics
from router.policy import RoutingRequest, block_hashes
from router.prompts import Prompt, chat_prompt, check_context_length, completion_prompts
from router.protocol import ChatCompletionRequest, CompletionRequest
from router import responses as R

SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"
Model = TypeVar("Model", bound=BaseModel)


@dataclass
class ServingState:
    """What the handlers share; one per app."""

    config: RouterConfig
    tokenizer: Tokenizer
    dispatcher: Dispatcher
    metrics: RouterMetrics
    default_max_model_len: int
    block_size: int = 16
    draining: bool = False

    def max_model_len(self) -> int:
        """The configured limit, else the smallest any ready pod reported, else the model's config."""
        if self.config.max_model_len is not None:
            return self.config.max_model_len
        reported = [p.model.max_model_len for p in self.dispatcher.tracker.pods.values()
                    if p.model is not None and p.model.max_model_len > 0]
        return min(reported) if reported else self.default_max_model_len


async def parse_body(request: Request, model: type[Model]) -> Model:
    body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(part) for part in error["loc"]]
        if error["type"] == "json_invalid":
            raise bad_request(f"Invalid JSON body: {error['msg']}", code="invalid_json") from None
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        raise bad_request(f"{where}: {error['msg']}", param=param) from None


def _slo_seconds(request: Request, header: str, default_ms: float) -> float:
    raw = request.headers.get(header)
    if raw is None:
        return default_ms / 1000.0
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise bad_request(f"header {header} must be a positive number of milliseconds, got {raw!r}", param=header)
    return value / 1000.0


def _check_model(state: ServingState, name: str | None) -> None:
    if name is not None and name != state.config.model_name:
        raise not_found(f"The model '{name}' does not exist; this server serves '{state.config.model_name}'.",
                        code="model_not_found")


def _sampling(build: Callable[[], SamplingParams]) -> SamplingParams:
    try:
        return build()
    except SamplingParamsError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def _specs(state: ServingState, http: Request, request_id: str, prompts: list[Prompt], n: int,
           params: list[SamplingParams], priority: int) -> list[SequenceSpec]:
    slo_ttft = _slo_seconds(http, SLO_TTFT_HEADER, state.config.slo_ttft_ms)
    slo_tpot = _slo_seconds(http, SLO_TPOT_HEADER, state.config.slo_tpot_ms)
    deadline = time.monotonic() + state.config.request_timeout_seconds
    specs = []
    for p, prompt in enumerate(prompts):
        hashes = block_hashes(prompt.token_ids, state.block_size)
        for j in range(n):
            index = p * n + j
            sampling = params[p]
            if sampling.seed is not None and n > 1:
                # Same seed for every choice would give n identical samples.
                sampling = replace(sampling, seed=(sampling.seed + j) % (1 << 63))
            routing = RoutingRequest(f"{request_id}-{index}", len(prompt.token_ids), sampling.max_tokens,
                                     slo_ttft, slo_tpot, hashes, state.block_size)
            specs.append(SequenceSpec(f"{request_id}-{index}", prompt.token_ids, sampling, routing,
                                      time.time(), deadline, priority))
    return specs


async def _until_disconnect(http: Request) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(http: Request, work: Awaitable[Any], run: RequestRun) -> Any:
    """Await `work`; if the client disconnects first, cancel the run (and so the pod calls)."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(http))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work_task.done():
        work_task.cancel()
        run.cancel()
        run.metrics.request_finished("cancelled")
        return Response(status_code=499)
    return work_task.result()


async def _collect(run: RequestRun, count: int) -> list[R.ChoiceResult]:
    results = [R.ChoiceResult() for _ in range(count)]
    async for event in run.events():
        result = results[event.index]
        result.text += event.text
        result.token_ids += event.token_ids
        result.logprobs += event.logprobs
        result.finish_reason = event.finish_reason or result.finish_reason
    return results


async def _execute(state: ServingState, http: Request, specs: list[SequenceSpec], stream: bool,
                   whole: Callable[[list[R.ChoiceResult], RequestRun], dict[str, Any]],
                   chunks: Callable[[RequestRun], AsyncIterator[str]]) -> Response:
    """Run the sequences; answer as one JSON body or as an SSE stream."""
    run = RequestRun(state.dispatcher, state.tokenizer, state.metrics, specs, time.monotonic())
    if not stream:
        async def work() -> Response:
            try:
                results = await _collect(run, len(specs))
            except BaseException:
                run.cancel()       # the other choices, if one failed
                state.metrics.request_finished("error")
                raise
            state.metrics.request_finished("success")
            return JSONResponse(whole(results, run))
        return await _unless_disconnected(http, work(), run)

    async def prime() -> None:
        try:
            await run.prime()
        except APIError as exc:
            state.metrics.request_finished("rejected" if exc.status in (429, 503) else "error")
            raise
    outcome = await _unless_disconnected(http, prime(), run)
    if isinstance(outcome, Response):
        return outcome

    async def body() -> AsyncIterator[str]:
        status = "cancelled"
        try:
            async for chunk in chunks(run):
                yield chunk
            status = "success"
        except APIError as exc:
            status = "error"
            yield R.sse(exc.body())
            yield R.sse("[DONE]")
        finally:
            run.cancel()
            state.metrics.request_finished(status)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def create_completion(state: ServingState, http: Request) -> Response:
    request = await parse_body(http, CompletionRequest)
    _check_model(state, request.model)
    if request.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if request.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of must equal n (best-of sampling is not supported)", param="best_of")
    if request.echo and request.logprobs is not None:
        raise bad_request("echo with logprobs is not supported (no prompt logprobs)", param="echo")
    _sampling(lambda: request.sampling_params(default_max_tokens=1))   # types and ranges first
    prompts = await completion_prompts(request, state.tokenizer)
    max_len = state.max_model_len()
    params = []
    for prompt in prompts:
        max_tokens = check_context_length(len(prompt.token_ids), request.max_tokens, max_len, "prompt", "max_tokens")
        params.append(_sampling(lambda: request.sampling_params(default_max_tokens=max_tokens)))
    request_id, created, model = _request_id("cmpl"), int(time.time()), state.config.model_name
    specs = _specs(state, http, request_id, prompts, request.n, params, request.priority)
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

    async def chunks(run: RequestRun) -> AsyncIterator[str]:
        include_usage = request.wants_usage_in_stream()
        offsets = [0] * len(specs)
        if request.echo:
            for i in range(len(specs)):
                offsets[i] = len(echo_text(i))
                yield R.sse(R.completion_body(request_id, created, model, [
                    {"index": i, "text": echo_text(i), "logprobs": None, "finish_reason": None}],
                    None) | ({"usage": None} if include_usage else {}))
        async for event in run.events():
            logprobs = None
            if request.logprobs is not None:
                logprobs = R.completion_logprobs(tokenizer, event.token_ids[:len(event.logprobs)], event.logprobs,
                                                 offsets[event.index])
            offsets[event.index] += len(event.text)
            body = R.completion_body(request_id, created, model, [
                {"index": event.index, "text": event.text, "logprobs": logprobs,
                 "finish_reason": event.finish_reason}], None)
            if not include_usage:
                body.pop("usage")
            yield R.sse(body)
        if include_usage:
            yield R.sse(R.completion_body(request_id, created, model, [],
                                          R.usage(num_prompt_tokens, sum(run.num_output_tokens))))
        yield R.sse("[DONE]")

    return await _execute(state, http, specs, request.stream, whole, chunks)


async def create_chat_completion(state: ServingState, http: Request) -> Response:
    request = await parse_body(http, ChatCompletionRequest)
    _check_model(state, request.model)
    if request.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
    if request.tools:
        raise bad_request("tools are not supported", param="tools")
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    max_tokens_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    _sampling(lambda: request.sampling_params(default_max_tokens=1))
    prompt = await chat_prompt(request, state.tokenizer)
    max_tokens = check_context_length(len(prompt.token_ids), request.requested_max_tokens(), state.max_model_len(),
                                      "messages", max_tokens_param)
    params = _sampling(lambda: request.sampling_params(default_max_tokens=max_tokens))
    request_id, created, model = _request_id("chatcmpl"), int(time.time()), state.config.model_name
    specs = _specs(state, http, request_id, [prompt], request.n, [params], request.priority)
    tokenizer = state.tokenizer

    def whole(results: list[R.ChoiceResult], run: RequestRun) -> dict[str, Any]:
        choices = [{"index": i, "message": {"role": "assistant", "content": result.text},
                    "logprobs": R.chat_logprobs(tokenizer, result.token_ids, result.logprobs) if request.logprobs else None,
                    "finish_reason": result.finish_reason} for i, result in enumerate(results)]
        return R.chat_body(request_id, created, model, choices,
                           R.usage(len(prompt.token_ids), sum(run.num_output_tokens)), chunk=False)

    async def chunks(run: RequestRun) -> AsyncIterator[str]:
        include_usage = request.wants_usage_in_stream()

        def chunk(choice: dict[str, Any]) -> str:
            body = R.chat_body(request_id, created, model, [choice], None, chunk=True)
            if not include_usage:
                body.pop("usage")
            return R.sse(body)

        for i in range(len(specs)):
            yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        async for event in run.events():
            yield chunk(_chat_delta(tokenizer, event, request.logprobs))
        if include_usage:
            yield R.sse(R.chat_body(request_id, created, model, [],
                                    R.usage(len(prompt.token_ids), sum(run.num_output_tokens)), chunk=True))
        yield R.sse("[DONE]")

    return await _execute(state, http, specs, request.stream, whole, chunks)


def _chat_delta(tokenizer: Tokenizer, event: ChoiceEvent, logprobs: bool) -> dict[str, Any]:
    delta = {"content": event.text} if event.text or event.finish_reason is None else {}
    return {"index": event.index, "delta": delta,
            "logprobs": R.chat_logprobs(tokenizer, event.token_ids, event.logprobs) if logprobs else None,
            "finish_reason": event.finish_reason}
