"""Compiled build artifacts kept by what their bytes depend on, so a build whose compiled code this
machine already made copies it instead of compiling again.

Two things a build compiles do not depend on the model's weights: the block-quantized kernel library
(its sources, flags, compiler and ISA) and a block engine's step package, which holds no weights
(they are bound by name from the weights file at load, compile_cpu.py). Every fine-tune of a base
model, and every rebuild whose limits leave the step's shapes unchanged, compiled the same bytes
again: 120 s of SmolLM2-Q4_K_M's 178 s build on 2 quiet cores (issue #39).

An entry is a folder holding the artifact and `entry.json` (the key's record and the artifact's
sha256). It is written under a temporary name and renamed into place whole, so a concurrent build
writing the same key leaves one complete entry (the second rename fails and its copy is dropped).
Every use checks the record and the checksum; an entry that fails is a miss with a warning and is
removed. The cache keeps at most `max_entries` entries and `max_bytes`, least recently used first
out. `ifb build --no-cache` compiles again (and stores the result).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ifb.runtime.step_budget.cost_model_cache import cache_root

logger = logging.getLogger(__name__)

ARTIFACT = "artifact"
ENTRY = "entry.json"
SUBDIR = "compiled"
# A block engine's step package is 2-40 MB of code, a kernel library ~1 MB: a few dozen shapes fit.
MAX_ENTRIES = 32
MAX_BYTES = 2 * 2**30


@dataclass(frozen=True, slots=True)
class ArtifactKey:
    """What an artifact's bytes depend on, as one JSON-able record; its hash names the entry."""

    kind: str  # the cache's subfolder: one per kind of artifact
    record: dict[str, Any]

    @classmethod
    def of(cls, kind: str, record: dict[str, Any]) -> ArtifactKey:
        return cls(kind, json.loads(json.dumps(record, sort_keys=True)))  # as JSON reads it back

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.record, sort_keys=True).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class ArtifactCache:
    """Compiled artifacts this machine made, one folder per key under `root`/<kind>."""

    def __init__(
        self, root: Path | None = None, reuse: bool = True, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES
    ) -> None:
        """`reuse=False` (`ifb build --no-cache`): every fetch misses, and what is built is stored."""
        self.root = (root or cache_root()) / SUBDIR
        self.reuse = reuse
        self.max_entries = max_entries
        self.max_bytes = max_bytes

    def _entry(self, key: ArtifactKey) -> Path:
        return self.root / key.kind / key.digest

    def fetch(self, key: ArtifactKey, target: Path) -> bool:
        """Copy the artifact stored under `key` to `target`; False on a miss (absent, or an entry
        whose record or checksum does not match, which is then removed)."""
        if not self.reuse:
            return False
        entry = self._entry(key)
        try:
            stored = json.loads((entry / ENTRY).read_text())
            if stored["key"] != key.record:
                raise ValueError("its key record differs (a hash collision or a hand-edited entry)")
            if file_sha256(entry / ARTIFACT) != stored["sha256"]:
                raise ValueError("its artifact fails the checksum")
        except FileNotFoundError:
            return False
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("compile cache entry %s is unusable (%s); compiling again", entry, error)
            shutil.rmtree(entry, ignore_errors=True)
            return False
        shutil.copyfile(entry / ARTIFACT, target)
        os.utime(entry)  # recently used: pruned last
        return True

    def store(self, key: ArtifactKey, artifact: Path) -> None:
        """Keep a copy of `artifact` under `key`, then prune. A cache that cannot be written (a
        read-only home, a full disk) costs only the reuse: a warning, never the build."""
        folder = self.root / key.kind
        try:
            folder.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=folder, prefix=".entry-"))
            try:
                shutil.copyfile(artifact, staging / ARTIFACT)
                record = {"key": key.record, "sha256": file_sha256(staging / ARTIFACT)}
                (staging / ENTRY).write_text(json.dumps(record))
                os.rename(staging, self._entry(key))
            except OSError:
                if not self._entry(key).is_dir():
                    raise
                # a concurrent build stored the same key first: keep its entry
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            self._prune()
        except OSError as error:
            logger.warning("%s not cached in %s: %s", key.kind, folder, error)

    def _prune(self) -> None:
        entries: list[tuple[float, int, Path]] = []
        for kind in self.root.iterdir():
            if not kind.is_dir():
                continue
            for entry in kind.iterdir():
                if entry.name.startswith("."):
                    continue
                try:
                    entries.append((entry.stat().st_mtime, (entry / ARTIFACT).stat().st_size, entry))
                except FileNotFoundError:  # pruned meanwhile by a concurrent build
                    continue
        kept_bytes = 0
        for index, (_, size, entry) in enumerate(sorted(entries, reverse=True)):
            kept_bytes += size
            if index >= self.max_entries or kept_bytes > self.max_bytes:
                shutil.rmtree(entry, ignore_errors=True)
