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
from pathlib import Path
from typing import Any

from ifb.ray_serve.ingress import IfbIngress
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
__all__ = ["ServeOptions", "build_app", "serve_engine", "shutdown", "start_ray"]

_reaper: list[object] = []  # the local instance's watcher, held so it is not collected as garbage


def build_app(engine: Path, settings: RuntimeSettings, options: ServeOptions) -> Any:
    """The Serve application for `engine` (a folder every Ray node can read)."""
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
        name=REPLICA_DEPLOYMENT,
        num_replicas=options.num_replicas,
        max_ongoing_requests=2 * capacity,
        ray_actor_options={"num_cpus": options.threads_per_replica},
        health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=max(10.0, 5 * options.health_check_period_s),
        request_router_config=RequestRouterConfig(**router),
    )
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


def start_ray(options: ServeOptions) -> None:
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
    wanted = options.num_replicas * options.threads_per_replica
    cpus = os.cpu_count() or 1
    if wanted > cpus:
        logger.warning(
            "%d replicas x %d threads oversubscribe this machine's %d CPUs",
            options.num_replicas,
            options.threads_per_replica,
            cpus,
        )
    _reaper.append(start_reaper())
    ray.init(num_cpus=max(cpus, wanted), include_dashboard=False)


def serve_engine(engine: Path, settings: RuntimeSettings, options: ServeOptions, blocking: bool = True) -> None:
    """Deploy and serve on http://host:port until interrupted (blocking) or return once ready."""
    from ray import serve
    from ray.serve.config import HTTPOptions

    # A SIGTERM at any point, start-up included, must reach the caller's shutdown(): Python's
    # default would kill the process before it, and once ray.init has run, Ray's C++ handler
    # aborts the process 3 s on (mid-shutdown), leaving the local instance's agents behind.
    with sigterm_exits():
        start_ray(options)
    with sigterm_exits():  # again: ray.init replaced the handler
        serve.start(http_options=HTTPOptions(host=options.host, port=options.port))
        app = build_app(engine, settings, options)
        logger.info(
            "deploying %d replica(s) of %s on Ray Serve, http://%s:%d",
            options.num_replicas,
            engine,
            options.host,
            options.port,
        )
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=blocking)


def shutdown() -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():
        return  # stopped before ray.init: serve.shutdown() would start a Ray instance to find none
    serve.shutdown()
    ray.shutdown()
