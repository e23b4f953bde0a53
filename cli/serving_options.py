"""The options `ifb run` and `ifb serve` share, each declared once, and the values made from them.

The runtime, server and build ones come from the fields of RuntimeSettings, ServerSettings and
BuildOptions (cli/field_options.py); the rest (the model checks, the API key's sources, logging)
belong to the command line and are declared here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from ifb.builder.build import BuildOptions
from ifb.builder.errors import BuildError
from ifb.cli.field_options import field_option, field_options, from_params, stack
from ifb.cli.logging_setup import LOG_FORMATS, LOG_LEVELS, configure_logging
from ifb.runtime.engine_format import DTYPE_ALIASES, ENGINE_JSON, EngineConfig
from ifb.runtime.errors import IfbError
from ifb.runtime.runtime_config import RuntimeSettings, ServerSettings

API_KEY_ENV = "IFB_API_KEY"
SERVING_OPTION_GROUPS = {
    "Model": ("dtype", "max_model_len", "chat_template"),
    "Limits": (
        "max_batch_size",
        "max_num_tokens",
        "max_queued_requests",
        "queue_timeout",
        "default_max_tokens",
        "guided_compile_timeout",
    ),
    "Scheduling": (
        "policy",
        "chunking",
        "enable_prefix_reuse",
        "prefix_cache_dir",
        "prefix_cache_disk_gb",
        "itl_target_ms",
        "ttft_target_ms",
        "calibrate",
    ),
    "Speculative decoding": (
        "speculative",
        "num_speculative_tokens",
        "prompt_lookup_max",
        "prompt_lookup_min",
        "suffix_cache_tokens",
        "draft_engine",
        "speculative_config",
    ),
    "Server": (
        "host",
        "port",
        "served_model_names",
        "api_key",
        "api_key_file",
        "allowed_origins",
        "reasoning_parser",
        "tool_call_parser",
    ),
    "Logging": ("log_level", "log_format", "trace"),
}

serving_options = stack(
    field_option(
        BuildOptions,
        "dtype",
        help="With a SOURCE: the dtype to build. With an engine folder: checked against the engine's.",
    ),
    click.option(
        "--max-model-len",
        type=click.IntRange(min=1),
        default=None,
        help="Longest prompt + output in tokens (ifb build's --max-seq-len). With a SOURCE: built in; "
        "with an engine folder: must equal the engine's max_seq_len.",
    ),
    click.option(
        "--chat-template",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help="A Jinja chat template FILE replacing the tokenizer's own (chat requests, and ifb run's --prompt).",
    ),
    field_options(RuntimeSettings),
    field_options(ServerSettings),
    click.option(
        "--api-key",
        default=None,
        help=f"Require Authorization: Bearer KEY on /v1/*. Visible to every user in `ps`: prefer "
        f"--api-key-file or the {API_KEY_ENV} environment variable.",
    ),
    click.option(
        "--api-key-file",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help="Read the API key from FILE.",
    ),
    click.option(
        "--log-level",
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        default="info",
        show_default=True,
        help="Least severe level logged (`ifb -v` alone means debug).",
    ),
    click.option(
        "--log-format",
        type=click.Choice(LOG_FORMATS),
        default="text",
        show_default=True,
        help="json: one object per line.",
    ),
)


def merge_groups(*mappings: Mapping[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """Option groups for GroupedCommand: each heading in its first place, its names joined in order."""
    merged: dict[str, tuple[str, ...]] = {}
    for mapping in mappings:
        for heading, names in mapping.items():
            merged[heading] = merged.get(heading, ()) + tuple(names)
    return merged


def resolve_api_key(api_key: str | None, api_key_file: Path | None, environ: Mapping[str, str]) -> str | None:
    """The key from --api-key, else --api-key-file (trailing whitespace dropped), else IFB_API_KEY;
    None serves without a key. An empty key is refused rather than silently meaning "no key"."""
    if api_key is not None and api_key_file is not None:
        raise click.UsageError("give --api-key or --api-key-file, not both")
    if api_key is not None:
        key, where = api_key, "--api-key"
    elif api_key_file is not None:
        try:
            key, where = api_key_file.read_text(encoding="utf-8").strip(), f"--api-key-file {api_key_file}"
        except (OSError, UnicodeDecodeError) as error:
            raise click.ClickException(f"cannot read --api-key-file {api_key_file}: {error}") from None
    elif API_KEY_ENV in environ:
        key, where = environ[API_KEY_ENV], API_KEY_ENV
    else:
        return None
    if not key:
        raise click.ClickException(f"the API key from {where} is empty")
    return key


def runtime_settings(params: Mapping[str, Any]) -> RuntimeSettings:
    """RuntimeSettings from the command's flags, --chat-template's file read."""
    path = params["chat_template"]
    try:
        chat_template = None if path is None else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise click.ClickException(f"cannot read --chat-template {path}: {error}") from None
    return from_params(RuntimeSettings, params, chat_template=chat_template)


def server_settings(params: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> ServerSettings:
    """ServerSettings from the command's flags, the API key from whichever of its sources is given."""
    api_key = resolve_api_key(params["api_key"], params["api_key_file"], environ)
    return from_params(ServerSettings, params, api_key=api_key)


def build_options_for(params: Mapping[str, Any]) -> BuildOptions:
    """What to build when TARGET is a SOURCE: at least the defaults, and what the flags ask for."""
    defaults = BuildOptions()
    return BuildOptions(
        max_batch_size=max(params["max_batch_size"] or 0, defaults.max_batch_size),
        max_num_tokens=max(params["max_num_tokens"] or 0, defaults.max_num_tokens),
        max_seq_len=params["max_model_len"] or defaults.max_seq_len,
        dtype=params["dtype"],
    )


def checked_engine_folder(target: str | None, params: Mapping[str, Any]) -> Path | None:
    """TARGET if it is an engine folder, after refusing --dtype / --max-model-len that it was not
    built with (naming both values and the rebuild command); None when TARGET is a SOURCE."""
    if target is None or not (Path(target) / ENGINE_JSON).is_file():
        return None
    folder, dtype, max_model_len = Path(target), params["dtype"], params["max_model_len"]
    engine = EngineConfig.load(folder, verify=False)  # LLM verifies the artifacts when it loads them
    wanted_dtype = DTYPE_ALIASES.get(dtype.lower())
    if wanted_dtype is not None and wanted_dtype != engine.dtype:
        overrides: dict[str, Any] = {"dtype": wanted_dtype}
        raise click.ClickException(
            f"--dtype {dtype}: engine {folder} was built with dtype {engine.dtype}, not {wanted_dtype}; "
            f"rebuild with: {engine.rebuild_command(**overrides)}"
        )
    baked = engine.limits.max_seq_len
    if max_model_len is not None and max_model_len > baked:
        raise click.ClickException(
            f"--max-model-len {max_model_len} exceeds engine {folder}'s max_seq_len {baked}; "
            f"rebuild with: {engine.rebuild_command(max_seq_len=max_model_len)}"
        )
    if max_model_len is not None and max_model_len < baked:
        # The runtime takes its sequence limit from the engine and cannot lower it yet.
        raise click.ClickException(
            f"--max-model-len {max_model_len} is below engine {folder}'s max_seq_len {baked}, and a running "
            f"engine cannot lower it; omit --max-model-len, or rebuild with: "
            f"{engine.rebuild_command(max_seq_len=max_model_len)}"
        )
    return folder


def engine_folder(target: str | None, params: Mapping[str, Any]) -> Path:
    """An engine folder as given (checked against --dtype / --max-model-len), else the one ifb
    built (or builds now, with the flags' build options) for the SOURCE."""
    from ifb.find_or_build import DEFAULT_ENGINES_DIR, find_or_build_engine

    try:  # a damaged engine.json is one line too, not a traceback
        folder = checked_engine_folder(target, params)
        return folder or Path(find_or_build_engine(target, build_options_for(params), DEFAULT_ENGINES_DIR))
    except (IfbError, BuildError) as error:
        raise click.ClickException(str(error)) from None


def setup_logging(ctx: click.Context, params: Mapping[str, Any]) -> str:
    """Logging as --log-level and --log-format say; returns the level, which `ifb -v run` (or
    serve) still makes debug unless --log-level is given explicitly."""
    verbose = ctx.parent is not None and ctx.parent.params.get("verbose", False)
    explicit = ctx.get_parameter_source("log_level") is not click.core.ParameterSource.DEFAULT
    log_level = params["log_level"].lower() if explicit or not verbose else "debug"
    configure_logging(log_level, params["log_format"])
    return log_level
