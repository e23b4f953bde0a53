"""The OpenAI-compatible HTTP server: app and routes, response shaping, stream handling."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ifb.runtime.server.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    # Lazy, so the settings (runtime_config) can name a parser kind of tool_parsers.py without
    # importing FastAPI into `from ifb import LLM` or the CLI's start.
    if name == "create_app":
        from ifb.runtime.server.app import create_app

        return create_app
    raise AttributeError(name)
