"""Write an engine folder atomically: artifacts + tokenizer + engine.json with sha256 of each."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ifb.builder.sources import sha256_of_file

ENGINE_FORMAT_VERSION = 1
ENGINE_JSON = "engine.json"


def artifact_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (relative paths), engine.json excluded."""
    return {
        str(path.relative_to(folder)): sha256_of_file(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != ENGINE_JSON
    }


@contextmanager
def atomic_engine_folder(output: Path) -> Iterator[Path]:
    """Yield a temp folder beside `output`; on success it replaces `output` in one rename."""
    output = output.resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.building-", dir=output.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would make the engine private to its builder
    try:
        yield staging
        if output.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
            output.rename(retired / output.name)
            staging.rename(output)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(output)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def write_engine_json(folder: Path, record: dict[str, Any]) -> None:
    record = {"format_version": ENGINE_FORMAT_VERSION, **record, "artifacts": artifact_hashes(folder)}
    (folder / ENGINE_JSON).write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
