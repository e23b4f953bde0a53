"""Each option is declared once, on its settings dataclass: `ifb build`, `ifb run` and `ifb serve`
take their flags' defaults, help and ranges from those fields, and `ifb serve` offers every
`ifb run` option that applies to a replica."""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any

import click
import pytest

from ifb.builder.build import BuildOptions
from ifb.cli.build_command import build
from ifb.cli.run_command import run
from ifb.cli.serve_command import SERVE_OPTION_GROUPS, serve
from ifb.cli.serving_options import build_options_for, runtime_settings, server_settings
from ifb.runtime.engine_format import BuildOptionsRecord
from ifb.runtime.errors import LimitExceededError
from ifb.runtime.runtime_config import (
    RouterSettings,
    RuntimeSettings,
    ServeOptions,
    ServerSettings,
    check_minimums,
)

# `ifb run` only: the one-shot prompt, the router's load/unload bounds (serve routes by model too,
# but deploys every model at start); a replica's threads are serve's --threads (an alias of
# --threads-per-replica).
RUN_ONLY = {
    "prompt",
    "max_tokens",
    "temperature",
    "threads",
    "models_dir",
    "max_loaded_models",
    "idle_unload_s",
    "models_memory_gb",
}


def options_of(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.params if isinstance(p, click.Option) and p.name is not None}


def flags_of(command: click.Command) -> set[str]:
    return {flag for option in options_of(command).values() for flag in (*option.opts, *option.secondary_opts)}


def cli_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def test_serve_accepts_every_run_option_that_applies_to_a_replica() -> None:
    run_options = options_of(run)
    applicable = {
        flag
        for name, option in run_options.items()
        if name not in RUN_ONLY | {"help"}
        for flag in (*option.opts, *option.secondary_opts)
    }
    assert applicable - flags_of(serve) == set()
    assert "--threads" in flags_of(serve) and "--calibrate" in flags_of(serve)


def test_every_serve_option_is_filed_under_a_heading() -> None:
    grouped = {name for names in SERVE_OPTION_GROUPS.values() for name in names}
    assert set(options_of(serve)) - grouped == set()  # --help is added at parse time, not a param


def test_serve_help_lists_every_applicable_run_option() -> None:
    text = serve.get_help(click.Context(serve, info_name="serve"))
    for name, option in options_of(run).items():
        if name not in RUN_ONLY | {"help"}:
            assert option.opts[0] in text, name


@pytest.mark.parametrize(
    ("command", "classes"),
    [
        (run, (RuntimeSettings, ServerSettings, RouterSettings)),
        (serve, (RuntimeSettings, ServerSettings, ServeOptions)),
        (build, (BuildOptions,)),
    ],
)
def test_flags_take_default_and_help_from_the_fields(command: click.Command, classes: tuple[type, ...]) -> None:
    options = options_of(command)
    for cls in classes:
        for spec in cli_fields(cls):
            option = options[spec.name]
            default = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
            assert option.default == plain(default) or (option.multiple and tuple(option.default or ()) == default)
            assert option.help == spec.metadata["help"], spec.name


def test_no_flags_make_the_dataclasses_defaults() -> None:
    params = run.make_context("run", []).params
    assert runtime_settings(params) == RuntimeSettings()
    assert server_settings(params, {}) == ServerSettings()
    assert build_options_for(params) == BuildOptions()
    assert BuildOptions(**{name: build.make_context("build", []).params[name] for name in BuildOptions.__slots__}) == (
        BuildOptions()
    )


def test_a_minimum_on_the_field_bounds_the_flag_and_the_setting() -> None:
    with pytest.raises(click.BadParameter):
        run.make_context("run", ["--default-max-tokens", "0"])
    with pytest.raises(click.BadParameter):
        serve.make_context("serve", ["--replicas", "0"])
    with pytest.raises(LimitExceededError, match="default_max_tokens must be >= 1, got 0"):
        check_minimums(RuntimeSettings(default_max_tokens=0))
    check_minimums(RuntimeSettings(max_queued_requests=0, itl_target_ms=0.0))


def test_serve_builds_a_source_with_runs_build_options() -> None:
    """`ifb serve SOURCE --max-batch-size 32` builds as `ifb run` does (it used BuildOptions())."""
    args = ["--max-batch-size", "32", "--max-num-tokens", "1024", "--max-model-len", "512", "--dtype", "fp32"]
    assert build_options_for(serve.make_context("serve", list(args)).params) == build_options_for(
        run.make_context("run", list(args)).params
    )
    assert build_options_for(serve.make_context("serve", list(args)).params) == BuildOptions(
        max_batch_size=32, max_num_tokens=1024, max_seq_len=512, dtype="fp32"
    )


def test_every_recorded_build_option_is_an_ifb_build_flag() -> None:
    """rebuild_command writes each BuildOptionsRecord field as the flag of its name."""
    flags = flags_of(build)
    assert {"--" + f.name.replace("_", "-") for f in dataclasses.fields(BuildOptionsRecord)} <= flags
