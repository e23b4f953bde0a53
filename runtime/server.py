"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics. Admission: 400 for bad input, 429 at once when full, 401 without the key."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ifb.runtime.errors import AdmissionError, QueueFullError
from ifb.runtime.llm import LLM
from ifb.runtime.metrics import Metrics
from ifb.runtime.openai_protocol import ChatCompletionRequest, CompletionRequest
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STUCK_STEP_S = 30.0  # a step running longer than this means the loop is stuck


class QueueTimeoutError(QueueFullError):
    pass


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_exceeded",
    }.get(status, "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code or kind}}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_field(error: RequestValidationError) -> tuple[str, str]:
    first = error.errors()[0]
    location = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(location) or "body"
    if first.get("type") == "json_invalid":
        return "body", "request body is not valid JSON"
    if first.get("type") == "extra_forbidden":
        return field, f"unrecognized request argument supplied: {field}"
    return field, f"{field}: {first.get('msg', 'invalid value')}"


async def _with_queue_timeout(
    llm: LLM, stream: AsyncIterator[RequestOutput], queue_timeout: float | None
) -> AsyncIterator[RequestOutput]:
    """A request that produces nothing within `queue_timeout` is aborted and refused (429)."""
    try:
        first = await asyncio.wait_for(stream.__anext__(), timeout=queue_timeout)
    except TimeoutError:
        await stream.aclose()  # type: ignore[attr-defined]
        llm.gate.refused += 1
        raise QueueTimeoutError(f"request waited longer than the queue timeout of {queue_timeout}s") from None
    except StopAsyncIteration:
        return
    yield first
    async for output in stream:
        yield output


def create_app(
    llm: LLM, *, api_key: str | None = None, queue_timeout: float | None = None, max_body_bytes: int = 4 << 20
) -> FastAPI:
    app = FastAPI(title="ifb", version="0.1.0")
    metrics = Metrics(llm)
    model_id = llm.model_name

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, error: RequestValidationError) -> JSONResponse:
        field, message = _validation_field(error)
        return error_response(400, message, param=field)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals (e.g. a body that is not UTF-8) in OpenAI's error shape.
        return error_response(
            error.status_code, f"request body: {error.detail}", param="body" if error.status_code == 400 else None
        )

    @app.exception_handler(AdmissionError)
    async def on_admission(_: Request, error: AdmissionError) -> JSONResponse:
        return error_response(400, str(error), param=error.field)

    @app.exception_handler(QueueFullError)
    async def on_full(_: Request, error: QueueFullError) -> JSONResponse:
        return error_response(429, str(error), headers={"Retry-After": "1"})

    app.add_middleware(_GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_id:
            raise _NotFound(f"model {name!r} does not exist; this server serves {model_id!r}")

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, error: Exception) -> JSONResponse:
        if isinstance(error, _NotFound):
            return error_response(404, str(error), param="model", code="model_not_found")
        logger.exception("unexpected error")
        return error_response(500, f"internal error: {type(error).__name__}")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_id,
                    "object": "model",
                    "created": 0,
                    "owned_by": "ifb",
                    "max_model_len": llm.engine_config.limits.max_seq_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        prompts = _completion_prompts(llm, body.prompt)
        return await _respond(raw, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        prompt = await asyncio.to_thread(llm.apply_chat_template, body.chat_messages())
        return await _respond(raw, body, [prompt], chat=True)

    async def _respond(
        raw: Request, body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]], chat: bool
    ) -> Response:
        jobs = [
            (p_index * body.n + j, prompt, body.sampling_params(j))
            for p_index, prompt in enumerate(prompts)
            for j in range(body.n)
        ]
        opened = llm.open_streams([(prompt, params) for _, prompt, params in jobs], block=False)
        streams = [_with_queue_timeout(llm, s, queue_timeout) for s in opened]
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.stream:
            try:  # a queue timeout (429) surfaces before any byte is sent
                first = list(await asyncio.gather(*(_first(s) for s in streams)))
            except BaseException:
                for stream in streams:
                    await stream.aclose()  # type: ignore[attr-defined]
                raise
            events = _sse(response_id, created, model_id, chat, jobs, streams, first, body)
            return StreamingResponse(events, media_type="text/event-stream")
        task = asyncio.ensure_future(_collect_all(streams))
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if not done and await raw.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        results = task.result()
        return JSONResponse(_final_body(response_id, created, model_id, chat, jobs, results, body))

    @app.get("/health")
    async def health() -> JSONResponse:
        executor = llm.executor
        since = executor.step_in_progress_since
        stuck = since is not None and time.monotonic() - since > STUCK_STEP_S
        alive = executor.is_alive and executor.fatal_error is None and not stuck
        limits = llm.engine_config.limits
        stats = llm.stats()
        body = {
            "status": "ok" if alive else "unhealthy",
            "executor": {"alive": executor.is_alive, "stuck": stuck, "error": executor.fatal_error},
            "model": model_id,
            "in_flight_batching": llm.config.max_batch_size > 1,
            "max_num_seqs": llm.config.max_batch_size,
            "engine_limits": limits.to_json(),
            "runtime_limits": {
                "max_batch_size": llm.config.max_batch_size,
                "max_num_tokens": llm.config.max_num_tokens,
                "max_queued_requests": llm.config.max_queued_requests,
                "policy": llm.config.policy.value,
                "chunking": llm.config.chunking.value,
                "enable_prefix_reuse": llm.config.enable_prefix_reuse,
            },
            "scheduling": {k: stats[k] for k in _SCHEDULING_KEYS},
            "kv_cache": {k: stats[k] for k in _KV_KEYS},
            "guided": {k: stats[k] for k in _GUIDED_KEYS},
        }
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


_SCHEDULING_KEYS = (
    "submitted",
    "completed",
    "cancelled",
    "failed",
    "refused",
    "admitted_mid_flight",
    "preempted",
    "stalls_no_capacity",
    "stalls_token_budget",
    "stalls_batch_full",
    "queue_latency_avg_us",
    "queue_latency_max_us",
    "queued",
    "resident",
)
_GUIDED_KEYS = ("guided_requests", "grammar_compile_seconds_total", "grammar_compile_seconds_max")
_KV_KEYS = (
    "kv_blocks_total",
    "kv_blocks_free",
    "kv_blocks_used",
    "kv_blocks_cached",
    "prefix_cache_queried_tokens",
    "prefix_cache_hit_tokens",
)


class _NotFound(Exception):
    pass


class _GuardMiddleware:
    """API key and body-size checks on /v1/*, as plain ASGI: Starlette's BaseHTTPMiddleware
    hides client disconnects from the endpoint, which must see them to cancel requests."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            refusal = None
            if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
                refusal = error_response(401, "missing or invalid API key (Authorization: Bearer KEY)")
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > self.max_body_bytes:
                refusal = error_response(
                    413, f"request body of {length} bytes exceeds the limit of {self.max_body_bytes}"
                )
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _completion_prompts(llm: LLM, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    if isinstance(prompt, str):
        return [llm.tokenize(prompt)]
    if not prompt:
        raise AdmissionError("prompt is empty", field="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [llm.tokenize(prompt)]  # type: ignore[arg-type]
    return [llm.tokenize(p) for p in prompt]  # type: ignore[arg-type]


async def _first(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _collect_all(streams: list[AsyncIterator[RequestOutput]]) -> list[list[RequestOutput]]:
    async def one(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
        return [o async for o in stream]

    try:
        return list(await asyncio.gather(*(one(s) for s in streams)))
    finally:
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]


def _logprobs_block(outputs: list[RequestOutput], chat: bool, llm_decode: Any = None) -> dict[str, Any] | None:
    entries = [lp for o in outputs for lp in o.logprobs]
    if not entries:
        return None
    if chat:
        return {
            "content": [
                {
                    "token": str(e.token_id),
                    "logprob": e.logprob,
                    "top_logprobs": [{"token": str(t), "logprob": v} for t, v in e.top.items()],
                }
                for e in entries
            ]
        }
    return {
        "tokens": [str(e.token_id) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{str(t): v for t, v in e.top.items()} for e in entries],
    }


def _usage(jobs: list[tuple[int, list[int], SamplingParams]], results: list[list[RequestOutput]]) -> dict[str, int]:
    prompt_tokens = sum(len(prompt) for _, prompt, _ in jobs)
    completion = sum(r[-1].num_output_tokens for r in results if r)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _final_body(
    response_id: str, created: int, model: str, chat: bool, jobs: list, results: list[list[RequestOutput]], body: Any
) -> dict[str, Any]:
    choices = []
    for (index, _, params), outputs in zip(jobs, results, strict=True):
        text = "".join(o.new_text for o in outputs)
        reason = outputs[-1].finish_reason.value if outputs and outputs[-1].finish_reason else None
        logprobs = _logprobs_block(outputs, chat) if params.logprobs is not None else None
        if chat:
            choices.append(
                {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": reason,
                    "logprobs": logprobs,
                }
            )
        else:
            choices.append({"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs})
    return {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(jobs, results),
    }


async def _sse(
    response_id: str,
    created: int,
    model: str,
    chat: bool,
    jobs: list,
    streams: list[AsyncIterator[RequestOutput]],
    first: list[RequestOutput | None],
    body: Any,
) -> AsyncIterator[str]:
    collected: list[list[RequestOutput]] = [[] for _ in jobs]
    merged, tasks = _merge(streams, first)
    kind = "chat.completion.chunk" if chat else "text_completion"
    try:
        if chat:
            for index, _, _ in jobs:
                yield _event(
                    {
                        "id": response_id,
                        "object": kind,
                        "created": created,
                        "model": model,
                        "choices": [
                            {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        ],
                    }
                )
        async for i, output in merged:
            collected[i].append(output)
            index, _, params = jobs[i]
            reason = output.finish_reason.value if output.finished and output.finish_reason else None
            logprobs = _logprobs_block([output], chat) if params.logprobs is not None else None
            choice: dict[str, Any] = {"index": index, "finish_reason": reason, "logprobs": logprobs}
            if chat:
                choice["delta"] = {"content": output.new_text} if output.new_text or not reason else {}
            else:
                choice["text"] = output.new_text
            yield _event({"id": response_id, "object": kind, "created": created, "model": model, "choices": [choice]})
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _event(
                {
                    "id": response_id,
                    "object": kind,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": _usage(jobs, collected),
                }
            )
        yield "data: [DONE]\n\n"
    finally:  # client gone or done: stop the pumps, which aborts unfinished requests
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await merged.aclose()
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]


def _merge(
    streams: list[AsyncIterator[RequestOutput]], first: list[RequestOutput | None]
) -> tuple[AsyncGenerator[tuple[int, RequestOutput]], list[asyncio.Task[None]]]:
    """(index, delta) from all streams as they come. One stream (n=1, the common case) is read
    directly; several are pumped into one queue by tasks the caller cancels when done."""
    if len(streams) == 1:

        async def single() -> AsyncGenerator[tuple[int, RequestOutput]]:
            if first[0] is not None:
                yield 0, first[0]
                async for output in streams[0]:
                    yield 0, output

        return single(), []
    queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput], head: RequestOutput | None) -> None:
        if head is not None:
            await queue.put((i, head))
            async for output in stream:
                await queue.put((i, output))
        await queue.put((i, None))

    async def drain() -> AsyncGenerator[tuple[int, RequestOutput]]:
        remaining = len(streams)
        while remaining:
            i, output = await queue.get()
            if output is None:
                remaining -= 1
            else:
                yield i, output

    tasks = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, first, strict=True))]
    return drain(), tasks


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
