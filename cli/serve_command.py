"""`ifb serve`: many replicas of one engine on Ray Serve behind one OpenAI-compatible endpoint.

Needs the [serve] extra (`pip install -e '.[serve]'`); `ifb run` never imports Ray.
"""

from __future__ import annotations

import logging
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
from ifb.runtime.runtime_config import ServeOptions

logger = logging.getLogger(__name__)

SERVE_OPTION_GROUPS = merge_groups(
    {"Ray Serve": ("num_replicas", "threads_per_replica", "ray_address")}, SERVING_OPTION_GROUPS
)


@click.command(cls=GroupedCommand, option_groups=SERVE_OPTION_GROUPS)
@click.argument("target", required=False)
@field_options(ServeOptions)
@serving_options
@click.pass_context
def serve(ctx: click.Context, target: str | None, **params: Any) -> None:
    """Serve TARGET (an engine folder or a model SOURCE) as REPLICAS engines on Ray Serve.

    Requests sharing a prompt prefix go to the replica holding it, others to the less loaded of
    two; a 429 only when every replica is full. Limits and scheduling apply to each replica. The
    engine folder must be readable at the same path on every Ray node.
    """
    setup_logging(ctx, params)
    try:
        import ray.serve  # noqa: F401
    except ImportError as error:
        raise click.ClickException(f"ifb serve needs Ray Serve: pip install -e '.[serve]' ({error})") from None
    from ifb.ray_serve.deploy import serve_engine, shutdown

    settings = runtime_settings(params)
    server = server_settings(params)
    options = from_params(ServeOptions, params, host=server.host, port=server.port, app_options=server.app_options())
    engine = engine_folder(target, params).resolve()
    try:
        serve_engine(engine, settings, options, blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        shutdown()
