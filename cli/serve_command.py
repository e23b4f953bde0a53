"""`ifb serve`: many replicas of one engine on Ray Serve behind one OpenAI-compatible endpoint.

Needs the [serve] extra (`pip install -e '.[serve]'`); `ifb run` never imports Ray.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from ifb.cli.field_options import field_options, from_params
from ifb.cli.logging_setup import configure_logging
from ifb.cli.option_groups import GroupedCommand
from ifb.cli.serving_options import (
    SERVING_OPTION_GROUPS,
    build_options_for,
    checked_engine_folder,
    effective_log_level,
    merge_groups,
    runtime_settings,
    server_settings,
    serving_options,
)
from ifb.runtime.errors import IfbError
from ifb.runtime.runtime_config import ServeOptions

logger = logging.getLogger(__name__)

SERVE_OPTION_GROUPS = merge_groups(
    {"Ray Serve": ("num_replicas", "threads_per_replica", "ray_address")}, SERVING_OPTION_GROUPS
)


def _engine_folder(target: str | None, params: Mapping[str, Any]) -> Path:
    """An engine folder as given (checked against --dtype / --max-model-len), else the one ifb
    built (or builds now, with the flags' build options) for the SOURCE."""
    folder = checked_engine_folder(target, params)
    if folder is not None:
        return folder
    from ifb.builder.errors import BuildError
    from ifb.find_or_build import DEFAULT_ENGINES_DIR, find_or_build_engine

    try:
        return Path(find_or_build_engine(target, build_options_for(params), DEFAULT_ENGINES_DIR))
    except (IfbError, BuildError) as error:
        raise click.ClickException(str(error)) from None


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
    configure_logging(effective_log_level(ctx, params["log_level"]), params["log_format"])
    try:
        import ray.serve  # noqa: F401
    except ImportError as error:
        raise click.ClickException(f"ifb serve needs Ray Serve: pip install -e '.[serve]' ({error})") from None
    from ifb.ray_serve.deploy import serve_engine, shutdown

    settings = runtime_settings(params)
    server = server_settings(params, os.environ)
    options = from_params(ServeOptions, params, host=server.host, port=server.port, app_options=server.app_options())
    engine = _engine_folder(target, params).resolve()
    try:
        serve_engine(engine, settings, options, blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        shutdown()
