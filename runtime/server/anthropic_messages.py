"""Anthropic's Messages API: `POST /v1/messages` and `/v1/messages/count_tokens`, on the OpenAI
chat route's request path (Routes' model check, then chat_requests.py: the chat prompt, the
reasoning budget, the sampling parameters, one EngineClient call), answered in Anthropic's shapes, errors included."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from ifb.runtime.errors import AdmissionError, EngineUnavailableError, QueueFullError
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.reasoning import NoReasoning
from ifb.runtime.request import FinishReason
from ifb.runtime.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from ifb.runtime.server.anthropic_replies import (
    ErrorBody,
    ErrorInfo,
    matched_stop,
    message_body,
    message_events,
    message_id,
)
from ifb.runtime.server.chat_requests import chat_prompt, prepare_chat
from ifb.runtime.server.errors import ModelNotFound, validation_field
from ifb.runtime.server.openai_protocol import ChatCompletionRequest
from ifb.runtime.server.responses import first_error
from ifb.runtime.server.routes import Routes
from ifb.runtime.server.streams import collect_all, first_delta

logger = logging.getLogger(__name__)
MESSAGES_PATH = "/v1/messages"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """`{"type": "error", "error": {"type": ..., "message": ...}}` with the HTTP status."""
    body = ErrorBody(error=ErrorInfo(type=_ERROR_TYPES.get(status, "api_error"), message=message))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


class AnthropicMessages:
    def __init__(self, routes: Routes) -> None:
        self.routes = routes
        self.engine = routes.engine

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        chat = self._checked(body, body.chat_request())
        prompt, _ = await chat_prompt(self.routes.serving, chat)
        return {"input_tokens": len(prompt)}

    async def messages(self, body: MessagesRequest, raw: Request) -> Response:
        chat = await prepare_chat(self.routes.serving, self._checked(body, body.chat_request()))
        choice, stream = await chat.open_one()
        params = choice.params
        shape = chat.shape(message_id(), body.model)
        if chat.body.stream:
            try:  # a queue timeout (429) surfaces before any byte is sent
                first = await first_delta(stream)
            except BaseException:
                await stream.aclose()  # type: ignore[attr-defined]
                raise
            events = message_events(shape, choice, stream, first, self._stop_finder(params.stop))
            return StreamingResponse(events, media_type="text/event-stream")
        task = asyncio.ensure_future(collect_all([stream]))
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if not done and await raw.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        (outputs,) = task.result()
        error = first_error([outputs])
        if error is not None or not outputs:  # the request failed inside the engine: not a 200
            return anthropic_error(500, error or "the request ended without output")
        stop = await self._stop_finder(params.stop)(outputs)
        try:
            return JSONResponse(message_body(shape, choice, outputs, stop).model_dump())
        except Exception as failure:  # a tool-call or reasoning parser raised: this response fails
            logger.exception("shaping message %s failed", shape.response_id)
            return anthropic_error(500, f"shaping the reply failed: {type(failure).__name__}: {failure}")

    def _checked(self, body: CountTokensRequest, chat: ChatCompletionRequest) -> ChatCompletionRequest:
        """The OpenAI route's checks, and a thinking budget that has no parser to keep it."""
        self.routes.check_request(chat)
        if chat.max_reasoning_tokens is not None and isinstance(self.routes.reasoning, NoReasoning):
            raise AdmissionError(
                "thinking needs a server with a reasoning parser (--reasoning-parser qwen3|deepseek_r1)",
                field="thinking",
            )
        return chat

    def _stop_finder(self, stops: tuple[str, ...]) -> Callable[[list[RequestOutput]], Coroutine[Any, Any, str | None]]:
        """Which stop sequence ended a reply (none for a reply the engine ended otherwise)."""

        async def find(outputs: list[RequestOutput]) -> str | None:
            if not stops or outputs[-1].finish_reason is not FinishReason.STOP:
                return None
            token_ids = [t for o in outputs for t in o.new_token_ids]
            return matched_stop(await self.engine.off_loop(self.engine.detokenize, token_ids), stops)

        return find


def anthropic_router(routes: Routes, retry_after_s: Callable[[], int]) -> APIRouter:
    """The two routes, every refusal in Anthropic's error shape (the app's handlers answer the
    OpenAI routes in OpenAI's)."""

    class AnthropicRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def answered(request: Request) -> Response:
                try:
                    return await handler(request)
                except Exception as error:
                    return _refusal(error, retry_after_s)

            return answered

    handlers = AnthropicMessages(routes)
    router = APIRouter(route_class=AnthropicRoute)
    router.post(MESSAGES_PATH)(handlers.messages)
    router.post(MESSAGES_PATH + "/count_tokens")(handlers.count_tokens)
    return router


def _refusal(error: Exception, retry_after_s: Callable[[], int]) -> JSONResponse:
    if isinstance(error, RequestValidationError):
        return anthropic_error(400, validation_field(error)[1])
    if isinstance(error, AdmissionError):
        return anthropic_error(400, str(error))
    if isinstance(error, ModelNotFound):
        return anthropic_error(404, str(error))
    if isinstance(error, QueueFullError):
        return anthropic_error(429, str(error), headers={"Retry-After": str(retry_after_s())})
    if isinstance(error, EngineUnavailableError):
        return anthropic_error(503, str(error))
    if isinstance(error, StarletteHTTPException):
        return anthropic_error(error.status_code, f"request body: {error.detail}")
    error_id = uuid.uuid4().hex[:12]
    logger.exception("unexpected error %s", error_id, exc_info=error)
    return anthropic_error(500, f"internal error {error_id}: {type(error).__name__} (the server log has it)")
