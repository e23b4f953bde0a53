"""The OpenAI-compatible HTTP server: app and routes, response shaping, stream handling."""

from ifb.runtime.server.app import create_app

__all__ = ["create_app"]
