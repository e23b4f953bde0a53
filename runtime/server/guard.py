"""The server's gate middleware, as plain ASGI (Starlette's BaseHTTPMiddleware hides client
disconnects from the endpoint, which must see them to cancel requests):

- the API key, compared in constant time, on every route but the liveness probe: as
  `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's);
- the body size, counted on the bytes actually received, so a chunked body (no Content-Length)
  is held to the same limit: the body is read here, and replayed to the app if it fits.
"""

from __future__ import annotations

import hmac
from typing import Any

from ifb.runtime.server.anthropic_messages import MESSAGES_PATH, anthropic_error
from ifb.runtime.server.errors import error_response

LIVENESS_PATH = "/health/live"  # answers without the key: says only that the process is up


class GuardMiddleware:
    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.expected_key = None if api_key is None else api_key.encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected is not None and self.expected_key is not None and scope["path"] != LIVENESS_PATH:
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
            if not (bearer | hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected_key)):
                message = "missing or invalid API key (Authorization: Bearer KEY or x-api-key: KEY)"
                await _refusal(scope["path"], 401, message)(scope, receive, send)
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(receive)
            if body is None:
                message = f"request body exceeds the limit of {self.max_body_bytes} bytes"
                await _refusal(scope["path"], 413, message)(scope, receive, send)
                return
            receive = replay_body(body, receive)
        await self.app(scope, receive, send)

    async def _read_body(self, receive: Any) -> bytes | None:
        """The whole body, or None as soon as it passes the limit (whatever the transfer encoding)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see an empty body
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _refusal(path: str, status: int, message: str) -> Any:
    """The error in the shape of the API the path belongs to."""
    if path.startswith(MESSAGES_PATH):
        return anthropic_error(status, message)
    return error_response(status, message)


def replay_body(body: bytes, receive: Any) -> Any:
    """A receive that hands the app the buffered body once, then the real channel (so the app
    still sees a disconnect while it streams)."""
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
