"""The router's HTTP app: `create_app(config)` builds it, `run(config)` serves it with uvicorn.

Startup (the app's lifespan) loads the tokenizer, starts discovery and load tracking, and wires
policy, admission and dispatch together. Routes: `/v1/completions`, `/v1/chat/completions`,
`/v1/responses` (stateless), `/v1/models`, `/tokenize`, `/detokenize`, `/tokenizer_info` (with its
flag; API key checked on these and every `/v1` route when one is configured; 503 with Retry-After
until a pod can serve the model), `/health` (liveness), `/ready` (503 with Retry-After while
draining or with no pod to route to), `/metrics`.

The OpenAPI document (`app.openapi()`, not served) carries the request bodies' JSON schemas, so
the schema fuzz (tests/router/test_openapi_fuzz.py) can generate requests from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.tokenizer import Tokenizer
from router.admission import STARTING_RETRY_AFTER_SECONDS
from router.config import RouterConfig
from router.discovery import Discovery, build_discovery
from router.dispatch import build_dispatcher
from router.errors import APIError, unauthorized, unavailable
from router.lora.admin import LoRAAdmin, add_lora_routes, model_cards
from router.metrics import RouterMetrics
from router.chat import create_chat_completion
from router.completions import create_completion
from router.prompts import PromptEncoder
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.serving import ServingState
from router.structured.plan import OutputFeatures
from router import tokenize as tok
from router.responses_api import create_response
from router.responses_api.protocol import ResponsesRequest

log = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 2048


def resolve_model_dir(model: str) -> Path:
    """A preset name or a directory holding tokenizer files and config.json (torch-free)."""
    from engine.presets import PRESETS, resolve_model_dir as resolve

    if model in PRESETS:
        return resolve(model, create_weights=False)
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"--model must be a preset ({', '.join(PRESETS)}) or a model directory, got {model!r}")
    return path


def max_model_len_of(model_dir: Path) -> int:
    config_file = model_dir / "config.json"
    if config_file.is_file():
        value = json.loads(config_file.read_text()).get("max_position_embeddings")
        if isinstance(value, int) and value > 1:
            return value
    return DEFAULT_MAX_MODEL_LEN


def create_app(config: RouterConfig, *, tokenizer: Tokenizer | None = None, discovery: Discovery | None = None,
               default_max_model_len: int | None = None) -> FastAPI:
    """The FastAPI app for `config`; `tokenizer`/`discovery` may be injected (tests, embedding)."""
    metrics = RouterMetrics()
    api_key = config.resolved_api_key()
    api_key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else b""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal tokenizer, discovery
        max_len = default_max_model_len
        if tokenizer is None:
            model_dir = resolve_model_dir(config.model)
            tokenizer = Tokenizer.from_pretrained(model_dir)
            max_len = max_len or max_model_len_of(model_dir)
        discovery = discovery or build_discovery(config)
        dispatcher = build_dispatcher(config, metrics)
        tracker = dispatcher.tracker
        encoder = PromptEncoder(tokenizer)
        output = await asyncio.to_thread(OutputFeatures.from_config, config, tokenizer)
        app.state.serving = ServingState(config, tokenizer, dispatcher, metrics, max_len or DEFAULT_MAX_MODEL_LEN,
                                         encoder, output=output)
        app.state.lora_admin = LoRAAdmin(tracker)
        app.state.lora_admin.start()
        discovery.subscribe(tracker.set_endpoints)
        await discovery.start()
        log.info("router serving %r with policy %s, admission %s", config.model_name, config.policy, config.admission)
        try:
            yield
        finally:
            try:
                await discovery.stop()
            finally:             # every pod channel closes with the router, whatever stopped first
                await app.state.lora_admin.stop()
                await tracker.close()
                encoder.close()

    app = FastAPI(title="cbserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics

    def serving(request: Request) -> ServingState:
        return request.app.state.serving

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        # Compare digests in constant time: timing reveals neither how much of a guess matched nor
        # the key's length.
        presented_digest = hashlib.sha256(presented.strip().encode()).digest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented_digest, api_key_digest):
            raise unauthorized()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, str(exc.errors()[0].get("msg", exc))).response()

    @app.exception_handler(ClientDisconnect)
    async def client_disconnect(request: Request, exc: ClientDisconnect) -> Response:
        # An ordinary event (the client closed the connection while sending its body): one INFO
        # line. Nobody reads the response.
        log.info("client disconnected while sending the body of %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # Not logged here: starlette re-raises after this handler and uvicorn logs the traceback,
        # so a log line here would report every bug twice.
        return APIError(500, f"Internal error: {type(exc).__name__}", type="server_error").response()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    def not_ready_retry_after(state: ServingState) -> str:
        starting = state.dispatcher.pods_starting()
        return str(int(STARTING_RETRY_AFTER_SECONDS if starting else 1))

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        state = serving(request)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "1"})
        if not state.dispatcher.is_ready():
            return JSONResponse({"status": "no ready pods"}, status_code=503,
                                headers={"Retry-After": not_ready_retry_after(state)})
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(check_api_key)])
    async def models(request: Request) -> dict[str, Any]:
        # Listed only once a pod can serve it, as vLLM does: clients and load generators poll this
        # to know when to start, so a 200 before the pods are ready would send them into 503s.
        state = serving(request)
        if not state.dispatcher.is_ready():
            raise unavailable(f"The model '{config.model_name}' is not ready yet: no pod can serve it.",
                              code="no_ready_pods", retry_after_seconds=float(not_ready_retry_after(state)))
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": int(time.time()), "owned_by": "cbserve",
            "max_model_len": state.max_model_len()}, *model_cards(state, int(time.time()))]}

    @app.post("/v1/completions", dependencies=[Depends(check_api_key)], openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await create_completion(serving(request), request)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_api_key)],
              openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(serving(request), request)

    @app.post("/v1/responses", dependencies=[Depends(check_api_key)], openapi_extra=_body_schema(ResponsesRequest))
    async def responses(request: Request) -> Response:
        return await create_response(serving(request), request)

    @app.post("/tokenize", dependencies=[Depends(check_api_key)], openapi_extra=_body_schema(tok.TokenizeRequest))
    async def tokenize(request: Request) -> dict[str, Any]:
        return await tok.tokenize(serving(request), request)

    @app.post("/detokenize", dependencies=[Depends(check_api_key)],
              openapi_extra=_body_schema(tok.DetokenizeRequest))
    async def detokenize(request: Request) -> dict[str, Any]:
        return await tok.detokenize(serving(request), request)

    if config.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info", dependencies=[Depends(check_api_key)])
        async def tokenizer_info(request: Request) -> dict[str, Any]:
            return tok.tokenizer_info(serving(request))

    add_lora_routes(app, serving, check_api_key)
    return app


def _body_schema(model: type) -> dict[str, Any]:
    """The OpenAPI `requestBody` of a route that parses its own body (see `serving.parse_body`),
    with pydantic's `$defs` inlined so the schema stands alone inside the document."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def run(config: RouterConfig) -> None:
    """Serve the router until SIGTERM/SIGINT, then drain (see `router.drain`)."""
    from router.drain import serve_with_drain

    serve_with_drain(create_app(config), config)
