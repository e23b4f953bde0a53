"""click options made from settings-dataclass fields: each option's flag, type, default, range
and help are read off its field (runtime_config.option), so they are written once, there."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Collection, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import click

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def _without_none(hint: Any) -> Any:
    """`X | None` -> X (None is the field's default, not a value to parse)."""
    if get_origin(hint) in (Union, types.UnionType):
        (hint,) = [arg for arg in get_args(hint) if arg is not type(None)]
    return hint


def _value_type(hint: Any, metadata: Mapping[str, Any]) -> Any:
    minimum = metadata.get("minimum")
    if "choices" in metadata:
        return click.Choice(metadata["choices"], case_sensitive=metadata.get("case_sensitive", True))
    if isinstance(hint, type) and issubclass(hint, Enum):
        return click.Choice([member.value for member in hint])
    if hint is Path:
        return click.Path(path_type=Path, exists=metadata.get("exists", False))
    if hint is int and minimum is not None:
        return click.IntRange(min=minimum)
    if hint is float and minimum is not None:
        return click.FloatRange(min=minimum)
    return hint


def field_option(cls: type, name: str, **overrides: Any) -> Callable[[F], F]:
    """The click option for field `name` of dataclass `cls`, its parameter named as the field;
    `overrides` are click.option keywords a command needs on top (e.g. its own help)."""
    spec = next(f for f in dataclasses.fields(cls) if f.name == name)
    metadata = spec.metadata
    hint = _without_none(get_type_hints(cls)[name])
    default = spec.default.value if isinstance(spec.default, Enum) else spec.default
    flags = [metadata.get("flag", "--" + name.replace("_", "-")), *metadata.get("aliases", ())]
    keywords: dict[str, Any] = {"default": default, "help": metadata.get("help"), "show_default": True}
    if hint is bool and default:  # on by default: it needs a --no- form to turn it off
        flags = [f"{flag}/--no-{flag.removeprefix('--')}" for flag in flags]
    elif hint is bool:
        keywords |= {"is_flag": True, "show_default": False}
    elif get_origin(hint) is tuple:  # repeatable
        keywords |= {"multiple": True, "show_default": False}
    else:
        keywords |= {"type": _value_type(hint, metadata), "show_default": default is not None}
    return click.option(*flags, name, **(keywords | overrides))


def cli_fields(cls: type) -> list[str]:
    """The fields of `cls` a flag sets (all but those marked cli=False)."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def field_options(cls: type, skip: Collection[str] = ()) -> Callable[[F], F]:
    """An option for every CLI field of `cls` but `skip`, listed in field order."""
    decorators = [field_option(cls, name) for name in cli_fields(cls) if name not in skip]
    return stack(*decorators)


def stack(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    """One decorator applying `decorators` as if written top to bottom above a function."""

    def apply(function: F) -> F:
        for decorator in reversed(decorators):
            function = decorator(function)
        return function

    return apply


def from_params(cls: type[T], params: Mapping[str, Any], **given: Any) -> T:
    """`cls` from a command's parameters (those naming one of its CLI fields), and `given`."""
    values = {name: params[name] for name in cli_fields(cls) if name in params}
    return cls(**(values | given))
