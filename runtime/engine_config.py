"""EngineConfig: an engine folder's engine.json, validated (format version, files, sha256)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ifb.builder.engine_writer import ENGINE_FORMAT_VERSION, ENGINE_JSON
from ifb.builder.limits import EngineLimits
from ifb.builder.model_spec import ModelSpec
from ifb.builder.sources import sha256_of_file
from ifb.runtime.errors import EngineFormatError


@dataclass(frozen=True, slots=True)
class EngineConfig:
    folder: Path
    model_name: str
    spec: ModelSpec
    limits: EngineLimits
    dtype: str
    backend: str
    rope_scaling: float
    step_package: Path
    weights: Path
    tokenizer_folder: Path
    record: dict[str, Any]


def _require(record: dict[str, Any], key: str, folder: Path) -> Any:
    if key not in record:
        raise EngineFormatError(f"{folder / ENGINE_JSON}: missing field {key!r}")
    return record[key]


def verify_artifacts(folder: Path, artifacts: dict[str, str]) -> None:
    for name, expected in artifacts.items():
        path = folder / name
        if not path.is_file():
            raise EngineFormatError(f"engine file {name!r} is missing from {folder}")
        actual = sha256_of_file(path)
        if actual != expected:
            raise EngineFormatError(
                f"engine file {name!r} is corrupted: sha256 {actual[:16]}… != recorded {expected[:16]}…"
            )


def load_engine_config(folder: str | Path, verify: bool = True) -> EngineConfig:
    """Read and check engine.json; with `verify`, every artifact's sha256 is checked."""
    folder = Path(folder).resolve()
    path = folder / ENGINE_JSON
    if not path.is_file():
        raise EngineFormatError(f"{folder} is not an engine folder: {ENGINE_JSON} is missing")
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise EngineFormatError(f"{path} is not valid JSON: {error}") from error
    version = _require(record, "format_version", folder)
    if version != ENGINE_FORMAT_VERSION:
        raise EngineFormatError(
            f"format_version {version} of {path} is not supported (this ifb reads version "
            f"{ENGINE_FORMAT_VERSION}); rebuild the engine with `ifb build`"
        )
    if verify:
        verify_artifacts(folder, _require(record, "artifacts", folder))
    try:
        spec = ModelSpec.from_json(_require(record, "model", folder))
        limits = EngineLimits(**_require(record, "limits", folder))
    except TypeError as error:
        raise EngineFormatError(f"{path}: malformed model or limits: {error}") from error
    return EngineConfig(
        folder=folder,
        model_name=_require(record, "model_name", folder),
        spec=spec,
        limits=limits,
        dtype=_require(record, "dtype", folder),
        backend=_require(record, "backend", folder),
        rope_scaling=float(_require(record, "rope_scaling", folder)),
        step_package=folder / _require(record, "step_package", folder),
        weights=folder / _require(record, "weights", folder),
        tokenizer_folder=folder / _require(record, "tokenizer", folder)["folder"],
        record=record,
    )
