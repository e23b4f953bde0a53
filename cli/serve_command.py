"""`ifb serve`: many replicas of one engine (or of each of several) on Ray Serve behind one
OpenAI-compatible endpoint.

Needs the [serve] extra (`pip install -e '.[serve]'`); `ifb run` never imports Ray.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import click

from ifb.cli.field_options import field_options, from_params
from ifb.cli.option_groups import GroupedCommand
from ifb.cli.serving_options import (
    SERVING_OPTION_GROUPS,
    engine_folder,
    merge_groups,
    runtime_settings,
    server_settings,
    serving_options,
    setup_logging,
)
from ifb.runtime.runtime_config import RouterSettings, ServeOptions

logger = logging.getLogger(__name__)

# Of the router's flags only --models-dir: every model is deployed at start (no loading on demand).
NOT_ON_SERVE = ("max_loaded_models", "idle_unload_s", "models_memory_gb")
SERVE_OPTION_GROUPS = merge_groups(
    {"Ray Serve": ("num_replicas", "threads_per_replica", "ray_address"), "Several models": ("models_dir",)},
    SERVING_OPTION_GROUPS,
)


@click.command(cls=GroupedCommand, option_groups=SERVE_OPTION_GROUPS)
@click.argument("targets", nargs=-1)
@field_options(ServeOptions)
@field_options(RouterSettings, skip=NOT_ON_SERVE)
@serving_options
@click.pass_context
def serve(ctx: click.Context, targets: tuple[str, ...], **params: Any) -> None:
    """Serve TARGET (an engine folder or a model SOURCE) as REPLICAS engines on Ray Serve.

    Requests sharing a prompt prefix go to the replica holding it, others to the less loaded of
    two; a 429 only when every replica is full. Limits and scheduling apply to each replica. The
    engine folder must be readable at the same path on every Ray node. Several TARGETs (or
    --models-dir) deploy REPLICAS of each, and a request goes to the model its body names.
    """
    setup_logging(ctx, params)
    try:
        import ray.serve  # noqa: F401
    except ImportError as error:
        raise click.ClickException(f"ifb serve needs Ray Serve: pip install -e '.[serve]' ({error})") from None
    from ifb.cli.many_models import named_targets
    from ifb.cli.run_command import router_settings
    from ifb.ray_serve.deploy import serve_engine, serve_models, shutdown

    settings = runtime_settings(params)
    server = server_settings(params)
    options = from_params(ServeOptions, params, host=server.host, port=server.port, app_options=server.app_options())
    router = router_settings(params)
    start: Callable[[], None]
    if len(targets) > 1 or router.in_use:
        named = named_targets(targets, router, server.served_model_names)
        engines = {name: engine_folder(target, params).resolve() for name, target in named}  # SOURCEs built now
        start = functools.partial(serve_models, engines, settings, options, blocking=True)
    else:
        engine = engine_folder(targets[0] if targets else None, params).resolve()
        start = functools.partial(serve_engine, engine, settings, options, blocking=True)
    try:
        start()
    except KeyboardInterrupt:
        pass
    finally:
        shutdown()
