"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`, on the
chat route's request path (Routes' checks, then chat_requests.py: prompt, reasoning budget,
sampling parameters, one EngineClient call), answered as a response object or its streamed
events (responses_api_output.py). Errors come in OpenAI's shape from the app's handlers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ifb.runtime.errors import AdmissionError
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.request import FinishReason
from ifb.runtime.server.chat_requests import prepare_chat
from ifb.runtime.server.errors import error_response
from ifb.runtime.server.responses import Choice, first_error
from ifb.runtime.server.responses_api_output import ItemStream, new_id
from ifb.runtime.server.responses_api_protocol import ResponsesRequest
from ifb.runtime.server.responses_api_store import MAX_STORED_RESPONSES, ResponseStore, StoredResponse
from ifb.runtime.server.routes import Routes
from ifb.runtime.server.streams import Stream, first_delta

logger = logging.getLogger(__name__)
RESPONSES_PATH = "/v1/responses"


@dataclass(frozen=True, slots=True)
class ResponseFrame:
    """One response's id, time and model, and what its object echoes of the request."""

    response_id: str
    created_at: int
    model: str
    request: ResponsesRequest

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        r = self.request
        text = r.text.model_dump(by_alias=True, exclude_none=True) if r.text is not None else {}
        choice = r.tool_choice
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": r.reasoning.model_dump() if r.reasoning is not None else {"effort": None, "summary": None},
            "service_tier": "default",
            "store": r.store,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": {"type": "text"}, **text},
            "tool_choice": choice.model_dump()
            if choice is not None and not isinstance(choice, str)
            else choice or "auto",
            "tools": r.tools or [],
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": r.user,
        }


class ResponsesApi:
    def __init__(self, routes: Routes, store: ResponseStore) -> None:
        self.routes = routes
        self.store = store

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        earlier = self._earlier(body.previous_response_id)
        chat = body.chat_request(earlier)
        self.routes.check_request(chat)
        prepared = await prepare_chat(self.routes.serving, chat)
        frame = ResponseFrame(new_id("response"), int(time.time()), body.model or self.routes.model_id, body)
        choice, stream = await prepared.open_one()
        items = ItemStream(prepared.shape(frame.response_id, frame.model).stream_for(choice))
        given = (
            [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
        )
        conversation = earlier + given
        if body.stream:
            try:  # a queue timeout (429) surfaces before any byte is sent
                first = await first_delta(stream)
            except BaseException:
                await stream.aclose()  # type: ignore[attr-defined]
                raise
            events = self._events(frame, items, choice, stream, first, conversation)
            return StreamingResponse(events, media_type="text/event-stream")
        outputs = await _collect_unless_gone(raw, stream)
        if outputs is None:
            return Response(status_code=499)
        error = first_error([outputs]) or (None if outputs else "the request ended without output")
        if error is not None:  # the request failed inside the engine: not a 200
            return error_response(500, error, code="request_failed")
        try:
            for output in outputs:
                items.feed(output)
            return JSONResponse(self._finished(frame, items, choice, outputs[-1], conversation))
        except Exception as failure:  # a tool-call or reasoning parser raised: this response fails
            logger.exception("shaping response %s failed", frame.response_id)
            return error_response(500, f"shaping the reply failed: {type(failure).__name__}: {failure}")

    async def retrieve(self, response_id: str) -> Response:
        stored = self.store.get(response_id)
        if stored is None:
            return _not_found(response_id)
        return JSONResponse(stored.body)

    async def delete(self, response_id: str) -> Response:
        if not self.store.delete(response_id):
            return _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    def _earlier(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        """The conversation so far, from the stored previous response."""
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise AdmissionError(
                f"previous_response_id {previous_response_id!r} is not stored here: this server keeps the "
                f"{MAX_STORED_RESPONSES} most recent responses made with store: true, in memory, until it restarts",
                field="previous_response_id",
            )
        return stored.conversation

    def _finished(
        self,
        frame: ResponseFrame,
        items: ItemStream,
        choice: Choice,
        last: RequestOutput,
        conversation: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """Close the reply's items; its body (stored when the request says store)."""
        status = items.finish(last)
        prompt_tokens, output_tokens = len(choice.prompt_token_ids), last.num_output_tokens
        usage = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": items.reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens,
        }
        body = frame.body(status, items.output, usage)
        if frame.request.store:
            self.store.put(frame.response_id, StoredResponse(body, conversation + items.output))
        return body

    async def _events(
        self,
        frame: ResponseFrame,
        items: ItemStream,
        choice: Choice,
        stream: Stream,
        first: RequestOutput | None,
        conversation: list[dict[str, Any]],
    ) -> AsyncIterator[str]:
        """response.created, response.in_progress, the items' events, then response.completed
        (response.incomplete when cut at max_output_tokens). A failure in the engine or in
        shaping ends the stream with response.failed (the HTTP status is already 200)."""
        yield items.event({"type": "response.created", "response": frame.body("in_progress", [])})
        yield items.event({"type": "response.in_progress", "response": frame.body("in_progress", [])})
        last: RequestOutput | None = None
        try:
            async for output in _chain(first, stream):
                last = output
                if output.finish_reason is FinishReason.ERROR:
                    yield _failed(frame, items, output.error or "request failed")
                    return
                items.feed(output)
                for line in items.take():
                    yield line
            if last is None:
                yield _failed(frame, items, "the request ended without output")
                return
            body = self._finished(frame, items, choice, last, conversation)
            for line in items.take():
                yield line
            kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
            yield items.event({"type": kind, "response": body})
        except Exception as error:  # never a cut connection: the client is told, the server goes on
            logger.exception("streaming response %s failed", frame.response_id)
            yield _failed(frame, items, f"shaping the reply failed: {type(error).__name__}: {error}")
        finally:  # client gone or done: closing the stream aborts an unfinished request
            await stream.aclose()  # type: ignore[attr-defined]


def add_responses_routes(app: FastAPI, routes: Routes, store: ResponseStore | None = None) -> None:
    api = ResponsesApi(routes, store or ResponseStore())
    app.post(RESPONSES_PATH)(api.create)
    app.get(RESPONSES_PATH + "/{response_id}")(api.retrieve)
    app.delete(RESPONSES_PATH + "/{response_id}")(api.delete)


def _failed(frame: ResponseFrame, items: ItemStream, message: str) -> str:
    error = {"code": "server_error", "message": message}
    return items.event({"type": "response.failed", "response": frame.body("failed", items.output, error=error)})


def _not_found(response_id: str) -> JSONResponse:
    message = (
        f"response {response_id!r} not found: this server keeps the {MAX_STORED_RESPONSES} most recent responses "
        "made with store: true, in memory, until it restarts"
    )
    return error_response(404, message, param="response_id", code="not_found")


async def _collect_unless_gone(raw: Request, stream: Stream) -> list[RequestOutput] | None:
    """All of the reply's deltas; None when the client left first (the request is aborted)."""
    task = asyncio.ensure_future(_all(stream))
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if not done and await raw.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
    return task.result()


async def _all(stream: Stream) -> list[RequestOutput]:
    try:
        return [output async for output in stream]
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def _chain(first: RequestOutput | None, stream: Stream) -> AsyncIterator[RequestOutput]:
    if first is None:
        return
    yield first
    async for output in stream:
        yield output
