"""The ingress deployment: the `ifb run` server app (create_app) over a ReplicaSetLLM, the
EngineClient whose requests run on the replicas and whose /health and /metrics come from every
replica's latest report (aggregate.py); with several models, `ifb run`'s model router over one
ReplicaSetLLM per model."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from fastapi import FastAPI

from ifb.ray_serve.proxy import ReplicaSetLLM
from ifb.runtime.runtime_config import RuntimeSettings
from ifb.runtime.server import create_app
from ifb.runtime.server.model_pool import ModelSpec
from ifb.runtime.server.model_router import ModelRouter, create_models_app

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


class IfbModelsIngress:
    """The ingress for several models: `ifb run`'s router (runtime/server/model_router.py) over one
    ReplicaSetLLM per model, so a request goes to the replicas of the model its body names, with
    the router's 404 for an unknown one, its /v1/models, /health and labelled /metrics."""

    def __init__(
        self,
        replicas: dict[str, Any],
        engines: dict[str, str],
        settings: RuntimeSettings,
        num_replicas: int,
        app_options: dict[str, Any],
    ) -> None:
        specs = [
            ModelSpec(
                name, functools.partial(ReplicaSetLLM, engines[name], settings, handle, num_replicas), engines[name]
            )
            for name, handle in replicas.items()
        ]
        self.router = create_models_app(specs, app_options)
        # Every model's replicas are deployed: its client (tokenizer, replica handle) is made now,
        # so /v1/models lists them loaded before the first request.
        self._warm = asyncio.ensure_future(self._load_all())

    async def _load_all(self) -> None:
        for name in self.router.pool.names:
            try:
                await self.router.pool.acquire(name)
                self.router.pool.release(name)
            except Exception:
                logger.exception("making model %s's client failed", name)

    def __serve_build_asgi_app__(self) -> ModelRouter:
        return self.router
