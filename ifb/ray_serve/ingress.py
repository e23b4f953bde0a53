"""The ingress deployment: the `ifb run` server app (create_app) over a ReplicaSetLLM, the
EngineClient whose requests run on the replicas and whose /health and /metrics come from every
replica's latest report (aggregate.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI

from ifb.ray_serve.proxy import ReplicaSetLLM
from ifb.runtime.runtime_config import RuntimeSettings
from ifb.runtime.server import create_app

logger = logging.getLogger(__name__)


class IfbIngress:
    """Wrapped by `serve.ingress()` and `serve.deployment` in deploy.py."""

    def __init__(
        self, replicas: Any, engine: str, settings: RuntimeSettings, num_replicas: int, app_options: dict[str, Any]
    ) -> None:
        """Serve constructs this inside its own async __init__: the event loop is running."""
        self.llm = ReplicaSetLLM(engine, settings, replicas, num_replicas)
        self.app_options = app_options
        self._warm = asyncio.ensure_future(self._start_router(replicas))

    async def _start_router(self, replicas: Any) -> None:
        """Send one call so Serve builds this process's router, which /health reads."""
        try:
            await replicas.options(method_name="ping").remote()
        except Exception:
            logger.exception("the first call to the replicas failed")

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.llm, **self.app_options)
