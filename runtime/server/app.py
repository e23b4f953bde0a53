"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics, OpenAI's /v1/responses and Anthropic's /v1/messages. Admission: 400 for bad input, 429
at once when full, 401 without the key, 503 when the step loop cannot serve."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ifb import __version__
from ifb.runtime.engine_client import EngineClient
from ifb.runtime.errors import AdmissionError, EngineUnavailableError, QueueFullError
from ifb.runtime.reasoning import ReasoningParserKind, make_reasoning_parser
from ifb.runtime.server.anthropic_messages import anthropic_router
from ifb.runtime.server.errors import ModelNotFound, error_response, validation_field
from ifb.runtime.server.guard import LIVENESS_PATH, GuardMiddleware
from ifb.runtime.server.responses_api import add_responses_routes
from ifb.runtime.server.routes import Routes
from ifb.runtime.server.tool_parsers import ToolCallParserKind, make_tool_call_parser, tool_call_parser_for_template

logger = logging.getLogger(__name__)


def create_app(
    engine: EngineClient,
    *,
    api_key: str | None = None,
    max_body_bytes: int = 4 << 20,
    served_model_names: tuple[str, ...] = (),
    allowed_origins: tuple[str, ...] = (),
    reasoning_parser: ReasoningParserKind | None = None,
    tool_call_parser: ToolCallParserKind | None = None,
) -> FastAPI:
    """The app over any EngineClient (the in-process LLM, or the Ray replica set).
    `served_model_names`: the names clients may use (the first is reported), default the
    engine's model name; `allowed_origins`: CORS origins (none by default: no CORS headers);
    `reasoning_parser`: how chat replies' reasoning is split off (runtime/reasoning.py);
    `tool_call_parser`: the format `auto` tool calls are read in (runtime/server/tool_parsers.py),
    default the one the engine's chat template teaches."""
    with_key = api_key is not None
    app = FastAPI(
        title="ifb",
        version=__version__,
        docs_url=None if with_key else "/docs",
        redoc_url=None if with_key else "/redoc",
        openapi_url=None if with_key else "/openapi.json",
    )
    if tool_call_parser is None:
        tool_call_parser = tool_call_parser_for_template(engine.chat_template)
        logger.info("tool calls (tool_choice auto): the %s format, the chat template's", tool_call_parser.value)
    tools = make_tool_call_parser(tool_call_parser)
    names = served_model_names or (engine.model_info.name,)
    routes = Routes(engine, names, make_reasoning_parser(reasoning_parser), tools)
    _add_error_handlers(app, engine)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    if allowed_origins:  # added last, so it runs first: preflight requests carry no API key
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )
    app.get(LIVENESS_PATH)(routes.live)
    app.get("/v1/models")(routes.models)
    app.get("/v1/models/{model_id:path}")(routes.model)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat)
    app.post("/tokenize")(routes.tokenize)
    app.post("/detokenize")(routes.detokenize)
    app.get("/version")(routes.version)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.metrics_text)
    add_responses_routes(app, routes)  # /v1/responses, OpenAI's Responses API
    app.include_router(anthropic_router(routes, engine.retry_after_s))  # /v1/messages, Anthropic's shapes
    return app


def _add_error_handlers(app: FastAPI, engine: EngineClient) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, error: RequestValidationError) -> JSONResponse:
        field, message = validation_field(error)
        return error_response(400, message, param=field)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals (e.g. a body that is not UTF-8) in OpenAI's error shape.
        param = "body" if error.status_code == 400 else None
        return error_response(error.status_code, f"request body: {error.detail}", param=param)

    @app.exception_handler(AdmissionError)
    async def on_admission(_: Request, error: AdmissionError) -> JSONResponse:
        return error_response(400, str(error), param=error.field)

    @app.exception_handler(QueueFullError)
    async def on_full(_: Request, error: QueueFullError) -> JSONResponse:
        return error_response(429, str(error), headers={"Retry-After": str(engine.retry_after_s())})

    @app.exception_handler(EngineUnavailableError)
    async def on_unavailable(_: Request, error: EngineUnavailableError) -> JSONResponse:
        return error_response(503, str(error))

    @app.exception_handler(ModelNotFound)
    async def on_not_found(_: Request, error: ModelNotFound) -> JSONResponse:
        return error_response(404, str(error), param="model", code="model_not_found")

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, error: Exception) -> JSONResponse:
        error_id = uuid.uuid4().hex[:12]
        logger.exception("unexpected error %s", error_id)
        return error_response(500, f"internal error {error_id}: {type(error).__name__} (the server log has it)")
