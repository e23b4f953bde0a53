"""Build the Serve application (N engine replicas + one ingress) and run it on Ray: a local
instance, or the cluster at --ray-address.

Serve limits, and why:
- replicas' max_ongoing_requests is twice the engine's admission limit, so Serve never queues
  a request the engine would seat: the engine refuses first and the ingress retries elsewhere
  (Serve's own queue would wait forever instead of answering 429).
- the ingress holds every open HTTP request, so its limit is the sum of the replicas' capacity.
- health checks every second, so a killed replica is noticed and replaced within seconds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ifb.ray_serve.ingress import IfbIngress, IfbModelsIngress
from ifb.ray_serve.reaper import start_reaper
from ifb.ray_serve.replica import IfbReplica
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.runtime_config import RuntimeSettings, ServeOptions, resolve_runtime_config
from ifb.stop_signal import sigterm_exits

logger = logging.getLogger(__name__)

APP_NAME = "ifb"
REPLICA_DEPLOYMENT = "ifb-replica"
INGRESS_DEPLOYMENT = "ifb-ingress"
ROUTER_CLASS = "ifb.ray_serve.router:PrefixAffinityRouter"
# ServeOptions lives beside the other settings (Ray-free, so the CLI can build flags from it).
__all__ = ["ServeOptions", "build_app", "build_models_app", "serve_engine", "serve_models", "shutdown", "start_ray"]

_reaper: list[object] = []  # the local instance's watcher, held so it is not collected as garbage


def build_app(engine: Path, settings: RuntimeSettings, options: ServeOptions) -> Any:
    """The Serve application for `engine` (a folder every Ray node can read)."""
    from ray import serve

    replica, capacity = _replicas(REPLICA_DEPLOYMENT, engine, settings, options)
    deployment: Any = serve.deployment  # its overloads hide .bind from mypy
    ingress = deployment(
        serve.ingress()(IfbIngress),
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=max(100, 2 * options.num_replicas * capacity),
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(
        replica.bind(str(engine), settings, options.threads_per_replica),
        str(engine),
        settings,
        options.num_replicas,
        dict(options.app_options),
    )


def build_models_app(engines: dict[str, Path], settings: RuntimeSettings, options: ServeOptions) -> Any:
    """The Serve application for several models: one replica deployment per model (its own
    --replicas of it, its own prefix-affinity router) and one ingress routing each request on its
    body's `model`, as `ifb run`'s router does (runtime/server/model_router.py)."""
    from ray import serve

    replicas: dict[str, Any] = {}
    total = 0
    for name, engine in engines.items():
        replica, capacity = _replicas(f"{REPLICA_DEPLOYMENT}-{name}", engine, settings, options)
        replicas[name] = replica.bind(str(engine), settings, options.threads_per_replica)
        total += options.num_replicas * capacity
    deployment: Any = serve.deployment
    ingress = deployment(
        serve.ingress()(IfbModelsIngress),
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=max(100, 2 * total),
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(
        replicas,
        {name: str(engine) for name, engine in engines.items()},
        settings,
        options.num_replicas,
        dict(options.app_options),
    )


def _replicas(name: str, engine: Path, settings: RuntimeSettings, options: ServeOptions) -> tuple[Any, int]:
    """One engine's replica deployment (unbound), and the requests one replica holds."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    engine_config = EngineConfig.load(engine, verify=False)
    config = resolve_runtime_config(engine_config, settings)
    capacity = config.max_batch_size + config.max_queued_requests
    router: dict[str, Any] = {
        "request_router_class": ROUTER_CLASS,
        "request_router_kwargs": {"block_size": engine_config.limits.block_size},
        "request_routing_stats_period_s": options.stats_period_s,
        "request_routing_stats_timeout_s": max(1.0, 2 * options.stats_period_s),
    }
    deployment: Any = serve.deployment  # its overloads hide .bind from mypy
    replica = deployment(
        IfbReplica,
        name=name,
        num_replicas=options.num_replicas,
        max_ongoing_requests=2 * capacity,
        ray_actor_options={"num_cpus": options.threads_per_replica},
        health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=max(10.0, 5 * options.health_check_period_s),
        request_router_config=RequestRouterConfig(**router),
    )
    return replica, capacity


# Ray Serve's controller kills and restarts its HTTP proxy when the proxy does not answer its first
# ready check within 5 s or a health check within 10 s, and serve.start then fails on the dead
# proxy (ActorDiedError). On a busy 2-core machine (the test suite beside two busy processes) the
# proxy's start took longer than that and `ifb serve` could not start at all. A local instance,
# which inherits this process's environment, gives its proxy the bound our replicas have.
_LOCAL_PROXY_CHECK_TIMEOUTS_S = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": 60.0,
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": 60.0,
}


def start_ray(options: ServeOptions, num_models: int = 1) -> None:
    """Join the cluster at ray_address, or start a local instance with enough CPUs for the
    replicas (oversubscribing a small machine rather than leaving replicas unscheduled). A local
    instance is ended with this process, however it ends (see reaper.py); a cluster joined is
    not ours to stop."""
    import ray

    if ray.is_initialized():
        return
    if options.ray_address is not None:
        ray.init(address=options.ray_address, include_dashboard=False)
        return
    wanted = num_models * options.num_replicas * options.threads_per_replica
    cpus = os.cpu_count() or 1
    if wanted > cpus:
        logger.warning(
            "%d model(s) x %d replicas x %d threads oversubscribe this machine's %d CPUs",
            num_models,
            options.num_replicas,
            options.threads_per_replica,
            cpus,
        )
    _reaper.append(start_reaper())
    for key, seconds in _LOCAL_PROXY_CHECK_TIMEOUTS_S.items():  # the user's own setting wins
        os.environ.setdefault(key, str(seconds))
    ray.init(num_cpus=max(cpus, wanted), include_dashboard=False)


def serve_engine(engine: Path, settings: RuntimeSettings, options: ServeOptions, blocking: bool = True) -> None:
    """Deploy and serve on http://host:port until interrupted (blocking) or return once ready."""
    _deploy(lambda: build_app(engine, settings, options), APP_NAME, str(engine), options, 1, blocking)


def serve_models(
    engines: dict[str, Path],
    settings: RuntimeSettings,
    options: ServeOptions,
    blocking: bool = True,
) -> None:
    """As serve_engine, for several models (name -> engine folder) behind one ingress routing by
    model name."""
    what = ", ".join(f"{name} ({folder})" for name, folder in engines.items())
    build = lambda: build_models_app(engines, settings, options)  # noqa: E731
    _deploy(build, f"{APP_NAME}-models", what, options, len(engines), blocking)


def _deploy(
    build: Callable[[], Any], name: str, what: str, options: ServeOptions, num_models: int, blocking: bool
) -> None:
    from ray import serve
    from ray.serve.config import HTTPOptions

    # A SIGTERM at any point, start-up included, must reach the caller's shutdown(): Python's
    # default would kill the process before it, and once ray.init has run, Ray's C++ handler
    # aborts the process 3 s on (mid-shutdown), leaving the local instance's agents behind.
    with sigterm_exits():
        start_ray(options, num_models)
    with sigterm_exits():  # again: ray.init replaced the handler
        serve.start(http_options=HTTPOptions(host=options.host, port=options.port))
        app = build()
        logger.info(
            "deploying %d replica(s) each of %s on Ray Serve, http://%s:%d",
            options.num_replicas,
            what,
            options.host,
            options.port,
        )
        serve.run(app, name=name, route_prefix="/", blocking=blocking)


def shutdown() -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():
        return  # stopped before ray.init: serve.shutdown() would start a Ray instance to find none
    serve.shutdown()
    ray.shutdown()
