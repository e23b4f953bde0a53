"""Many models behind one server: an ASGI app that hands each request to the app of the model it
names (create_app over that model's engine, made when the model loads; runtime/server/model_pool.py
loads and unloads them). POST bodies are read once, their JSON "model" field picks the model, and
the body is replayed to its app. GET /v1/models lists every configured model with its state,
/health every model's state (a loaded one's own health report), /metrics every loaded model's
series with a `model` label."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from ifb import __version__
from ifb.runtime.server.anthropic_messages import MESSAGES_PATH, anthropic_error
from ifb.runtime.server.errors import error_response
from ifb.runtime.server.guard import LIVENESS_PATH, GuardMiddleware, replay_body
from ifb.runtime.server.model_memory import GB, NoMemoryError
from ifb.runtime.server.model_pool import LoadedModel, ModelLoadError, ModelPool, ModelSpec, ModelState, NoRoomError

logger = logging.getLogger(__name__)

MODELS_PATH = "/v1/models"


def create_router_app(
    specs: list[ModelSpec],
    make_app: Callable[[LoadedModel, str], Any],
    *,
    max_loaded_models: int | None = None,
    idle_unload_s: float | None = None,
    models_memory_gb: float | None = None,
    api_key: str | None = None,
    max_body_bytes: int = 4 << 20,
    allowed_origins: tuple[str, ...] = (),
) -> ModelRouter:
    """The router over `specs` (names unique); `make_app(engine, name)` is one model's app
    (create_app, whose own CORS should be off: the router adds it once, outside)."""
    names = [spec.name for spec in specs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"model names must be unique; served more than once: {', '.join(duplicates)}")
    if max_loaded_models is not None and max_loaded_models < 1:
        raise ValueError(f"--max-loaded-models (max_loaded_models) must be >= 1, got {max_loaded_models}")
    if idle_unload_s is not None and not idle_unload_s > 0:
        raise ValueError(f"--idle-unload-s (idle_unload_s) must be > 0, got {idle_unload_s}")
    if models_memory_gb is not None and not models_memory_gb > 0:
        raise ValueError(f"--models-memory (models_memory_gb) must be > 0, got {models_memory_gb:g}")
    budget = None if models_memory_gb is None else int(models_memory_gb * GB)
    pool = ModelPool(specs, make_app, max_loaded_models, idle_unload_s, memory_budget=budget)
    return ModelRouter(pool, api_key, max_body_bytes, allowed_origins)


def create_models_app(specs: list[ModelSpec], app_options: dict[str, Any], **bounds: Any) -> ModelRouter:
    """The router over `specs`, each model served by create_app with `app_options` (ServerSettings'
    app_options(): `ifb run`'s and `ifb serve`'s flags) under its own name; `bounds`:
    create_router_app's max_loaded_models, idle_unload_s, models_memory_gb."""
    from ifb.runtime.server import create_app

    def make_app(engine: LoadedModel, name: str) -> Any:
        # The router checks the key and the body size and adds CORS once, for every route.
        return create_app(engine, **(app_options | {"served_model_names": (name,), "allowed_origins": ()}))

    return create_router_app(
        specs,
        make_app,
        api_key=app_options.get("api_key"),
        max_body_bytes=app_options.get("max_body_bytes", 4 << 20),
        allowed_origins=tuple(app_options.get("allowed_origins", ())),
        **bounds,
    )


class ModelRouter:
    def __init__(self, pool: ModelPool, api_key: str | None, max_body_bytes: int, origins: tuple[str, ...]) -> None:
        self.pool = pool
        # The key and the body limit hold for the router's own routes too, checked once, here.
        app: Any = GuardMiddleware(self._route, api_key=api_key, max_body_bytes=max_body_bytes)
        if origins:
            app = CORSMiddleware(app, allow_origins=list(origins), allow_methods=["*"], allow_headers=["*"])
        self._app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await self._app(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.pool.start_idle_unloads()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.pool.close()  # every engine's step loop stops, off the event loop
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _route(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path, method = _route_path(scope), scope["method"]  # behind a route prefix (Ray Serve's) too
        if method == "POST":
            await self._dispatch(scope, receive, send)
            return
        if method == "GET" and path in (MODELS_PATH, "/health", "/metrics", LIVENESS_PATH, "/version"):
            own = {
                MODELS_PATH: self._models,
                "/health": self._health,
                "/metrics": self._metrics,
                LIVENESS_PATH: lambda: JSONResponse({"status": "alive"}),
                "/version": lambda: JSONResponse({"version": __version__}),
            }
            await own[path]()(scope, receive, send)
            return
        if method == "GET" and path.startswith(MODELS_PATH + "/"):
            await self._model_card(path.removeprefix(MODELS_PATH + "/"))(scope, receive, send)
            return
        await error_response(404, f"no route {method} {path}")(scope, receive, send)

    async def _dispatch(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = _route_path(scope)
        body = await _read_body(receive)
        try:
            named = json.loads(body).get("model")
        except (ValueError, AttributeError):  # not JSON, or not an object
            await _refusal(path, 400, "request body is not a JSON object")(scope, receive, send)
            return
        if not isinstance(named, str) or named not in self.pool.slots:
            what = "names no model" if named is None else f"names model {named!r}, which this server does not serve"
            message = f"the request {what}; this server serves {', '.join(self.pool.names)}"
            await _refusal(path, 404, message, param="model")(scope, receive, send)
            return
        try:
            app = await self.pool.acquire(named)
        except (NoRoomError, NoMemoryError, ModelLoadError) as error:
            await _refusal(path, 503, str(error))(scope, receive, send)
            return
        try:
            await app(scope, replay_body(body, receive), send)
        finally:
            self.pool.release(named)

    def _card(self, name: str) -> dict[str, Any]:
        slot = self.pool.slots[name]
        card: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "ifb"}
        if slot.engine is not None:
            card["max_model_len"] = slot.engine.model_info.max_model_len
        status = self.pool.status(name)
        memory = {key: status[key] for key in ("memory_bytes", "memory_estimated") if key in status}
        return card | {"status": slot.state.value} | memory

    def _models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._card(name) for name in self.pool.names]})

    def _model_card(self, name: str) -> JSONResponse:
        if name not in self.pool.slots:
            message = f"model {name!r} does not exist; this server serves {', '.join(self.pool.names)}"
            return error_response(404, message, param="model", code="model_not_found")
        return JSONResponse(self._card(name))

    def _health(self) -> JSONResponse:
        """Each model's state; a loaded one's own health report under `health`. 503 when a loaded
        model cannot serve (an unloaded one is not a failure: a request loads it)."""
        models: dict[str, Any] = {}
        ok = True
        for name, slot in self.pool.slots.items():
            models[name] = self.pool.status(name)
            if slot.engine is not None:
                report = slot.engine.health_report()
                models[name]["health"] = report.body
                ok = ok and report.ok
        body: dict[str, Any] = {"status": "ok" if ok else "unavailable", "models": models}
        memory = self.pool.memory()
        if memory is not None:
            body["models_memory"] = memory
        return JSONResponse(body, status_code=200 if ok else 503)

    def _metrics(self) -> PlainTextResponse:
        registry = CollectorRegistry(auto_describe=False)
        loaded = {n: s.engine for n, s in self.pool.slots.items() if s.engine is not None}
        registry.register(_Labelled({name: engine.metrics_text() for name, engine in loaded.items()}))
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class _Labelled:
    """A collector of the models' exposition texts, each series labelled with its model."""

    def __init__(self, texts: dict[str, bytes]) -> None:
        self.texts = texts

    def collect(self) -> list[Any]:
        families: dict[str, Any] = {}
        for name, text in self.texts.items():
            for family in text_string_to_metric_families(text.decode()):
                merged = families.setdefault(family.name, family)
                labelled = [s._replace(labels={**s.labels, "model": name}) for s in family.samples]
                if merged is family:
                    family.samples = labelled
                else:
                    merged.samples.extend(labelled)
        return list(families.values())


def _refusal(path: str, status: int, message: str, param: str | None = None) -> JSONResponse:
    """The error in the shape of the API the path belongs to."""
    if path.startswith(MESSAGES_PATH):
        return anthropic_error(status, message)
    code = "model_not_found" if status == 404 else None
    return error_response(status, message, param=param, code=code)


def _route_path(scope: dict[str, Any]) -> str:
    """The path below the app's root_path (what a route prefix, such as Ray Serve's, adds)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root + "/") else path


async def _read_body(receive: Any) -> bytes:
    chunks: list[bytes] = []
    while True:  # GuardMiddleware has already held the body to the size limit
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


__all__ = ["ModelRouter", "ModelSpec", "ModelState", "create_models_app", "create_router_app"]
