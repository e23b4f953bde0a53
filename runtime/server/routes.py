"""The OpenAI-compatible endpoints' handlers: parse -> prepare off the loop -> seat -> respond."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ifb import __version__
from ifb.runtime.engine_client import EngineClient
from ifb.runtime.errors import AdmissionError
from ifb.runtime.reasoning import ReasoningParser
from ifb.runtime.server.chat_requests import (
    ChatServing,
    OpenAIRequest,
    PreparedChat,
    choice_params,
    prepare_chat,
)
from ifb.runtime.server.errors import ModelNotFound, error_response
from ifb.runtime.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from ifb.runtime.server.responses import Choice, ResponseShape, first_error
from ifb.runtime.server.streams import close_all, collect_all, first_delta, refuse_queue_timeouts, sse_events
from ifb.runtime.server.tool_parsers import ToolCallParser

logger = logging.getLogger(__name__)


class Routes:
    def __init__(
        self,
        engine: EngineClient,
        model_names: tuple[str, ...],
        reasoning: ReasoningParser,
        tool_parser: ToolCallParser,
    ) -> None:
        self.engine = engine
        self.reasoning = reasoning
        self.tool_parser = tool_parser
        self.model_names = model_names
        self.model_id = model_names[0]
        self.serving = ChatServing(engine, reasoning, tool_parser)  # the chat path all three APIs share

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise ModelNotFound(f"model {name!r} does not exist; this server serves {', '.join(self.model_names)}")

    async def live(self) -> dict[str, str]:
        return {"status": "alive"}

    def _card(self, name: str) -> dict[str, Any]:
        limit = self.engine.model_info.max_model_len
        return {"id": name, "object": "model", "created": 0, "owned_by": "ifb", "max_model_len": limit}

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._card(name) for name in self.model_names]}

    async def model(self, model_id: str) -> dict[str, Any]:
        self.check_model(model_id)
        return self._card(model_id)

    def check_request(self, body: OpenAIRequest) -> None:
        """Refusals that need no tokenizing: the model, unsupported fields, and more choices
        (prompts x n) than the whole engine can ever hold (a 400: retrying cannot help)."""
        self.check_model(body.model)
        body.refuse_unsupported()
        choices, capacity = body.num_prompts * body.n, self.engine.capacity
        if choices > capacity:
            raise AdmissionError(
                f"{body.num_prompts} prompt(s) x n={body.n} = {choices} requests exceed this server's capacity of "
                f"{capacity} (max_batch_size + max_queued_requests)",
                field="n" if body.num_prompts == 1 else "prompt",
            )

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        self.check_request(body)
        prompts = await self.engine.off_loop(_completion_prompts, self.engine, body.prompt)
        return await self.respond(raw, body, prompts)

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_request(body)
        return await self.respond(raw, body, chat=await prepare_chat(self.serving, body))

    async def respond(
        self,
        raw: Request,
        body: OpenAIRequest,
        prompts: list[list[int]] | None = None,
        chat: PreparedChat | None = None,
    ) -> Response:
        """A completion of `prompts`, or the `chat` request prepared from `body` (n choices each)."""
        params = chat.params if chat is not None else lambda j: choice_params(body, j, None, False)
        prompts = [chat.prompt_token_ids] if chat is not None else prompts or []
        choices = [
            Choice(p_index * body.n + j, p_index, prompt, params(j))
            for p_index, prompt in enumerate(prompts)
            for j in range(body.n)
        ]
        opened = await self.engine.open_streams([(c.prompt_token_ids, c.params) for c in choices])
        streams = [refuse_queue_timeouts(s) for s in opened]
        response_id = ("chatcmpl-" if chat is not None else "cmpl-") + uuid.uuid4().hex
        if chat is not None:
            shape = chat.shape(response_id, self.model_id)
        else:
            shape = ResponseShape(response_id, int(time.time()), self.model_id, False, self.engine.token_text)
        if body.stream:
            return await self._stream(shape, choices, streams, body)
        task = asyncio.ensure_future(collect_all(streams))
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if not done and await raw.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        results = task.result()
        error = first_error(results)
        if error is not None:  # a choice failed inside the engine: not a 200
            return error_response(500, error, code="request_failed")
        try:
            return JSONResponse(shape.final_body(choices, results).model_dump())
        except Exception as failure:  # a tool-call or reasoning parser raised: this response fails
            logger.exception("shaping response %s failed", response_id)
            message = f"shaping the reply failed: {type(failure).__name__}: {failure}"
            return error_response(500, message, code="request_failed")

    async def _stream(
        self, shape: ResponseShape, choices: list[Choice], streams: list[Any], body: OpenAIRequest
    ) -> Response:
        try:  # a queue timeout (429) surfaces before any byte is sent
            first = list(await asyncio.gather(*(first_delta(s) for s in streams)))
        except BaseException:
            await close_all(streams)
            raise
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = sse_events(shape, choices, streams, first, bool(include_usage))
        return StreamingResponse(events, media_type="text/event-stream")

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages)
            ids = await self.engine.off_loop(
                self.engine.apply_chat_template, chat.chat_messages(), None, body.chat_template_kwargs
            )
        elif body.prompt is not None:
            ids = await self.engine.off_loop(self.engine.tokenize, body.prompt)
        else:
            raise AdmissionError("give prompt or messages", field="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.model_info.max_model_len}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        return {"prompt": await self.engine.off_loop(self.engine.detokenize, body.tokens)}

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    async def health(self) -> JSONResponse:
        report = self.engine.health_report()
        body = {**report.body, "model": self.model_id}  # the name clients use, as /v1/models says
        return JSONResponse(body, status_code=200 if report.ok else 503)

    async def metrics_text(self) -> Response:
        return PlainTextResponse(self.engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)


def _completion_prompts(engine: EngineClient, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    if isinstance(prompt, str):
        return [engine.tokenize(prompt)]
    if not prompt:
        raise AdmissionError("prompt is empty", field="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [engine.tokenize(prompt)]  # type: ignore[arg-type]
    return [engine.tokenize(p) for p in prompt]  # type: ignore[arg-type]
