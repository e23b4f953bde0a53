"""The server's gate middleware: API key and body size, as plain ASGI (Starlette's
BaseHTTPMiddleware hides client disconnects from the endpoint, which must see them to cancel)."""

from __future__ import annotations

from typing import Any

from ifb.runtime.server.errors import error_response


class GuardMiddleware:
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
