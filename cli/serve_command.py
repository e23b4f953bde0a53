"""`ifb serve`: many replicas of one engine on Ray Serve behind one OpenAI-compatible endpoint.

Needs the [serve] extra (`pip install -e '.[serve]'`); `ifb run` never imports Ray.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import click

from ifb.cli.logging_setup import LOG_LEVELS, configure_logging
from ifb.cli.run_command import read_chat_template, resolve_api_key
from ifb.runtime.engine_format import ENGINE_JSON
from ifb.runtime.errors import IfbError
from ifb.runtime.policies import CapacityPolicyKind, ChunkingPolicyKind
from ifb.runtime.runtime_config import RuntimeSettings

logger = logging.getLogger(__name__)


def _engine_folder(target: str | None) -> Path:
    """An engine folder as given, else the one ifb built (or builds now) for the SOURCE."""
    if target is not None and (Path(target) / ENGINE_JSON).is_file():
        return Path(target)
    from ifb.builder.build import BuildOptions
    from ifb.builder.errors import BuildError
    from ifb.find_or_build import DEFAULT_ENGINES_DIR, find_or_build_engine

    try:
        return Path(find_or_build_engine(target, BuildOptions(), DEFAULT_ENGINES_DIR))
    except (IfbError, BuildError) as error:
        raise click.ClickException(str(error)) from None


@click.command()
@click.argument("target", required=False)
@click.option("--replicas", type=click.IntRange(min=1), default=2, show_default=True, help="Engine replicas.")
@click.option("--ray-address", default=None, help="Join this Ray cluster (default: start a local instance).")
@click.option(
    "--threads-per-replica",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Compute threads of each replica (and the CPUs Ray reserves for it).",
)
@click.option("--max-batch-size", "--max-num-seqs", "max_batch_size", type=int, default=None)
@click.option("--max-num-tokens", "--max-num-batched-tokens", "max_num_tokens", type=int, default=None)
@click.option("--max-queued-requests", type=int, default=64, show_default=True, help="Per replica.")
@click.option("--queue-timeout", type=float, default=None, help="Seconds a request may wait before a 429.")
@click.option("--default-max-tokens", type=int, default=512, show_default=True)
@click.option(
    "--policy",
    type=click.Choice([p.value for p in CapacityPolicyKind]),
    default="guaranteed_no_evict",
    show_default=True,
)
@click.option("--chunking", type=click.Choice([c.value for c in ChunkingPolicyKind]), default="fcfs", show_default=True)
@click.option("--enable-prefix-reuse/--no-enable-prefix-reuse", default=True, show_default=True)
@click.option("--itl-target-ms", type=click.FloatRange(min=0), default=None)
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--served-model-name", "served_model_names", multiple=True)
@click.option("--api-key", default=None, help="Prefer --api-key-file or IFB_API_KEY.")
@click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option("--allowed-origins", multiple=True)
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default="info", show_default=True)
def serve(
    target: str | None,
    replicas: int,
    ray_address: str | None,
    threads_per_replica: int,
    max_batch_size: int | None,
    max_num_tokens: int | None,
    max_queued_requests: int,
    queue_timeout: float | None,
    default_max_tokens: int,
    policy: str,
    chunking: str,
    enable_prefix_reuse: bool,
    itl_target_ms: float | None,
    chat_template: Path | None,
    host: str,
    port: int,
    served_model_names: tuple[str, ...],
    api_key: str | None,
    api_key_file: Path | None,
    allowed_origins: tuple[str, ...],
    log_level: str,
) -> None:
    """Serve TARGET (an engine folder or a model SOURCE) as REPLICAS engines on Ray Serve.

    Requests sharing a prompt prefix go to the replica holding it, others to the less loaded of
    two; a 429 only when every replica is full. The engine folder must be readable at the same
    path on every Ray node.
    """
    configure_logging(log_level.lower())
    try:
        import ray.serve  # noqa: F401
    except ImportError as error:
        raise click.ClickException(f"ifb serve needs Ray Serve: pip install -e '.[serve]' ({error})") from None
    from ifb.ray_serve.deploy import ServeOptions, serve_engine, shutdown

    settings = RuntimeSettings(
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_queued_requests=max_queued_requests,
        policy=CapacityPolicyKind(policy),
        chunking=ChunkingPolicyKind(chunking),
        enable_prefix_reuse=enable_prefix_reuse,
        default_max_tokens=default_max_tokens,
        chat_template=read_chat_template(chat_template),
        itl_target_ms=itl_target_ms,
    )
    app_options = {
        "api_key": resolve_api_key(api_key, api_key_file, os.environ),
        "queue_timeout": queue_timeout,
        "served_model_names": served_model_names,
        "allowed_origins": allowed_origins,
    }
    options = ServeOptions(
        num_replicas=replicas,
        threads_per_replica=threads_per_replica,
        ray_address=ray_address,
        host=host,
        port=port,
        app_options=app_options,
    )
    engine = _engine_folder(target).resolve()
    try:
        serve_engine(engine, settings, options, blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        shutdown()
