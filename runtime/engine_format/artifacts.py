"""Artifact integrity: sha256 of engine files, recorded at build and checked at load."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ifb.runtime.errors import EngineFormatError

ENGINE_JSON = "engine.json"


def sha256_of_file(path: Path) -> str:
    with open(path, "rb") as handle:  # file_digest reads in chunks: a weights file is not loaded whole
        return hashlib.file_digest(handle, "sha256").hexdigest()


def artifact_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (relative paths), engine.json excluded."""
    return {
        str(path.relative_to(folder)): sha256_of_file(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != ENGINE_JSON
    }


def confined_path(folder: Path, relative: str, field: str) -> Path:
    """`folder / relative`, refusing anything that resolves outside the engine folder: an
    engine.json must not point the loader at files elsewhere on the machine."""
    path = (folder / relative).resolve()
    if not path.is_relative_to(folder.resolve()):
        raise EngineFormatError(f"{folder / ENGINE_JSON}: {field} {relative!r} points outside the engine folder")
    return path


def verify_artifacts(folder: Path, artifacts: dict[str, str]) -> None:
    for name, expected in artifacts.items():
        path = confined_path(folder, name, "artifact")
        if not path.is_file():
            raise EngineFormatError(f"engine file {name!r} is missing from {folder}")
        actual = sha256_of_file(path)
        if actual != expected:
            raise EngineFormatError(
                f"engine file {name!r} is corrupted: sha256 {actual[:16]}… != recorded {expected[:16]}…"
            )
