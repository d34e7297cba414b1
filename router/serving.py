"""What the /v1/completions and /v1/chat/completions handlers share: validate, run, respond.

Order matters: the body is parsed and every parameter, the model name and the context length are
checked before anything is routed, so a bad request never reaches a pod. A streaming response
starts only after every choice has been admitted and has its first token (`RequestRun.prime`), so
429/503 arrive as real statuses; after that, errors travel as an SSE `error` event. A client that
goes away cancels the run, which cancels the pod calls; that is logged once, at INFO.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from engine.sampling.params import SamplingParams, SamplingParamsError
from engine.tokenizer import Tokenizer
from router import responses as R
from router.config import RouterConfig
from router.dispatch import Dispatcher, SequenceSpec
from router.errors import APIError, bad_request, not_found
from router.generation import ChoiceEvent, RequestRun
from router.lora.state import prefix_root, served_adapters
from router.metrics import RouterMetrics
from router.policy import RoutingRequest, block_hashes
from router.prompts import Prompt, PromptEncoder
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.request_body import check_json_containers, read_body
from router.structured.plan import OutputFeatures

log = logging.getLogger(__name__)
SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"
Model = TypeVar("Model", bound=BaseModel)
log = logging.getLogger(__name__)


@dataclass
class ServingState:
    """What the handlers share; one per app."""

    config: RouterConfig
    tokenizer: Tokenizer
    dispatcher: Dispatcher
    metrics: RouterMetrics
    default_max_model_len: int
    encoder: PromptEncoder
    default_block_size: int = 16
    draining: bool = False
    output: OutputFeatures | None = None      # structured outputs, tools, reasoning (router/structured/plan.py)

    def max_model_len(self) -> int:
        """The configured limit, else the smallest any ready pod reported, else the model's config."""
        if self.config.max_model_len is not None:
            return self.config.max_model_len
        reported = [p.model.max_model_len for p in self.dispatcher.tracker.pods.values()
                    if p.model is not None and p.model.max_model_len > 0]
        return min(reported) if reported else self.default_max_model_len

    def block_size(self) -> int:
        """The pods' KV block size (prefix affinity hashes whole blocks, as the pods' caches do)."""
        for pod in self.dispatcher.tracker.pods.values():
            if pod.model is not None and pod.model.block_size > 0:
                return pod.model.block_size
        return self.default_block_size


# What a field that accepts several shapes expects, for a readable message when none fits.
_UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "TextPart", "function-after", "json-or-python"}


def _is_type_tag(part: str) -> bool:
    # pydantic names the union member it tried: "str", "list[int]", "list[list[int]]", ...
    return part in _TYPE_TAGS or "[" in part


def _field(error: Any) -> list[str]:
    return [str(part) for part in error["loc"] if not _is_type_tag(str(part))]


async def parse_body(request: Request, model: type[Model], max_bytes: int) -> Model:
    """The validated body, or a 413 past `max_bytes`, or a 400 naming the first offending field
    (OpenAI's `param`)."""
    body = await read_body(request, max_bytes)
    check_json_containers(body)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False)   # inputs can be megabytes
        error = errors[0]
        if error["type"] == "json_invalid":
            raise bad_request(f"Invalid JSON body: {error['msg']}", code="invalid_json") from None
        loc = _field(error)
        param = loc[0] if loc else None
        same_field = [e for e in errors if _field(e)[:1] == loc[:1]]
        # A list past its cap: say so, rather than that no member of the field's union fit.
        too_long = next((e for e in same_field if e["type"] == "too_long"), None)
        if too_long is not None:
            ctx = too_long["ctx"]
            got = f", got {ctx['actual_length']}" if ctx.get("actual_length") is not None else ""
            raise bad_request(f"{'.'.join(_field(too_long))}: at most {ctx['max_length']} items{got}",
                              param=param) from None
        where = ".".join(loc) or "body"
        same_field = [e for e in errors if _field(e) == loc]
        if len(same_field) > 1 and loc and loc[-1] in _UNION_FIELDS:
            raise bad_request(f"{where}: must be {_UNION_FIELDS[loc[-1]]}", param=param) from None
        raise bad_request(f"{where}: {error['msg']}", param=param) from None


def slo_seconds(request: Request, header: str, default_ms: float) -> float:
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


def check_model(state: ServingState, name: str | None) -> str | None:
    """The LoRA adapter `name` selects (None: the base model), or 404 for an unknown model."""
    if name is None or name == state.config.model_name:
        return None
    if state.config.enable_lora and name in served_adapters(state.dispatcher.tracker.pods.values()):
        return name
    raise not_found(f"The model '{name}' does not exist; this server serves '{state.config.model_name}'"
                    f"{' and its LoRA adapters (GET /v1/models)' if state.config.enable_lora else ''}.",
                    code="model_not_found")


def check_common(state: ServingState, request: CompletionRequest | ChatCompletionRequest) -> str | None:
    """What both endpoints refuse before looking at the prompt: an unknown model, `logit_bias`,
    `stream_options` without streaming (OpenAI answers 400), stop token ids outside the vocabulary.
    Returns the LoRA adapter the request selects (None: the base model)."""
    lora = check_model(state, request.model)
    if request.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    vocab_size = state.tokenizer.vocab_size
    for token_id in request.stop_token_ids or ():
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"stop_token_ids: token id {token_id} is out of range [0, {vocab_size})",
                              param="stop_token_ids")
    return lora


def sampling_or_400(build: Callable[[], SamplingParams], rename: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams from `build`, or a 400 naming the field as the client spelled it (`rename`)."""
    try:
        return build()
    except SamplingParamsError as exc:
        param = (rename or {}).get(exc.param, exc.param)
        raise bad_request(f"{param}: {exc.message}", param=param) from None


def build_specs(state: ServingState, http: Request, request_id: str, prompts: list[Prompt], n: int,
                params: list[SamplingParams], priority: int, lora: str | None = None) -> list[SequenceSpec]:
    slo_ttft = slo_seconds(http, SLO_TTFT_HEADER, state.config.slo_ttft_ms)
    slo_tpot = slo_seconds(http, SLO_TPOT_HEADER, state.config.slo_tpot_ms)
    deadline = time.monotonic() + state.config.request_timeout_seconds
    specs = []
    block_size = state.block_size()
    for p, prompt in enumerate(prompts):
        hashes = block_hashes(prompt.token_ids, block_size, prefix_root(lora))
        for j in range(n):
            index = p * n + j
            sampling = params[p]
            if sampling.seed is not None and n > 1:
                # Same seed for every choice would give n identical samples.
                sampling = replace(sampling, seed=(sampling.seed + j) % (1 << 63))
            routing = RoutingRequest(f"{request_id}-{index}", len(prompt.token_ids), sampling.max_tokens,
                                     slo_ttft, slo_tpot, hashes, block_size, lora_name=lora or "")
            specs.append(SequenceSpec(f"{request_id}-{index}", prompt.token_ids, sampling, routing,
                                      time.time(), deadline, priority, lora_name=lora or ""))
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
        log.info("request %s: client disconnected before the response", _request_id(run))
        return Response(status_code=499)
    return work_task.result()


def _request_id(run: RequestRun) -> str:
    """The HTTP request's id (a choice's id less its `-index`)."""
    return run.choices[0].spec.request_id.rpartition("-")[0]


async def _collect(run: RequestRun, count: int) -> list[R.ChoiceResult]:
    results = [R.ChoiceResult() for _ in range(count)]
    await run.prime()
    async for event in run.events():
        result = results[event.index]
        result.text += event.text
        result.token_ids += event.token_ids
        result.logprobs += event.logprobs
        result.finish_reason = event.finish_reason or result.finish_reason
        result.prompt_logprobs = event.prompt_logprobs or result.prompt_logprobs
    return results


def _failure_status(exc: Exception) -> str:
    """`cbserve_requests_total{status}` for a failed request: refused by admission, or an error."""
    return "rejected" if isinstance(exc, APIError) and exc.status in (429, 503) else "error"


def sse_error(exc: APIError) -> str:
    """A failure after the stream began: the error object, then the end of the stream."""
    return R.sse(exc.body()) + R.sse("[DONE]")


@dataclass(frozen=True)
class StreamFormat:
    """How an endpoint streams: the SSE text before any event (chat's role deltas, an echo), one
    chunk per event (from a pre-rendered template in the common case), the end (usage, [DONE]),
    and a failure after the stream began."""

    head: str
    chunk: Callable[[ChoiceEvent], str]
    tail: Callable[[RequestRun], str]
    error: Callable[[APIError], str] = sse_error


async def execute(state: ServingState, http: Request, arrival: float, specs: list[SequenceSpec], stream: bool,
                  whole: Callable[[list[R.ChoiceResult], RequestRun], dict[str, Any]],
                  stream_format: Callable[[], StreamFormat]) -> Response:
    """Run the sequences; answer as one JSON body or as an SSE stream.

    `arrival` (monotonic) is when the HTTP request arrived: client-facing TTFT counts from there,
    tokenization included. Streaming, each pod message becomes one SSE write, made by the task
    that read the message (one choice) or by the one merging the choices' events (n > 1).
    """
    run = RequestRun(state.dispatcher, state.tokenizer, state.metrics, specs, arrival, replayable=not stream)
    if not stream:
        async def work() -> Response:
            try:
                results = await _collect(run, len(specs))
            except asyncio.CancelledError:
                raise              # the client went away: counted by _unless_disconnected
            except Exception as exc:
                run.cancel()       # the other choices, if one failed
                state.metrics.request_finished(_failure_status(exc))
                raise
            state.metrics.request_finished("success")
            return JSONResponse(whole(results, run))
        return await _unless_disconnected(http, work(), run)

    async def prime() -> None:
        try:
            await run.prime()
        except Exception as exc:
            state.metrics.request_finished(_failure_status(exc))
            raise
    outcome = await _unless_disconnected(http, prime(), run)
    if isinstance(outcome, Response):
        return outcome
    fmt = stream_format()

    async def body() -> AsyncIterator[str]:
        # One write per event; the head goes out with the first, the tail with the last one.
        status = "cancelled"
        try:
            head, chunk, unfinished = fmt.head, fmt.chunk, len(specs)
            async for event in run.events():
                text = chunk(event)
                if head:
                    text, head = head + text, ""
                if event.finish_reason is not None:
                    unfinished -= 1
                    if not unfinished:
                        text += fmt.tail(run)
                yield text
            status = "success"
        except APIError as exc:
            status = "error"
            yield fmt.error(exc)
        except Exception as exc:   # noqa: BLE001 - the client still gets a clean end of stream
            log.exception("stream of %s failed", specs[0].request_id)
            status = "error"
            yield fmt.error(APIError(500, f"Internal error: {type(exc).__name__}", type="server_error",
                                     code="internal_error"))
        finally:
            run.cancel()
            state.metrics.request_finished(status)
            if status == "cancelled":
                log.info("request %s: client disconnected mid-stream", _request_id(run))

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
