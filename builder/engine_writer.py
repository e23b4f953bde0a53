"""Write an engine folder atomically: artifacts + tokenizer first, then engine.json with the sha256
of each (the record itself comes from the runtime's engine format)."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ifb.runtime.engine_format import EngineConfig, artifact_hashes


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


def write_engine_json(folder: Path, config: EngineConfig) -> None:
    """Record the sha256 of every file already in `folder`, then write engine.json."""
    dataclasses.replace(config, artifacts=artifact_hashes(folder)).write(folder)
