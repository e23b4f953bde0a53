"""Write an engine folder atomically: artifacts + tokenizer first, then engine.json with the sha256
of each (the record itself comes from the runtime's engine format), published over the old engine
in one rename only once it is complete, verified and on disk.

Beside `engines/NAME` a build keeps `.NAME.lock` (held while it builds, so two builds of one path
take turns) and stages into `.NAME.building-*`. A build killed with SIGKILL leaves its staging
folder, which is no engine until published; the next build of NAME, holding the lock, knows every
such folder is dead and removes it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ifb.builder.errors import BuildError
from ifb.runtime.engine_format import ENGINE_JSON, EngineConfig, artifact_hashes
from ifb.runtime.errors import EngineFormatError

logger = logging.getLogger(__name__)

_RENAME_EXCHANGE = 2  # renameat2(2): swap two paths in one step
_AT_FDCWD = -100


@contextmanager
def atomic_engine_folder(output: Path) -> Iterator[Path]:
    """Yield a temp folder beside `output`; on success it replaces `output` in one rename. Any
    OSError (a full disk, a read-only folder) becomes one BuildError naming `output` and the cause."""
    output = output.resolve()
    try:
        _check_replaceable(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        with _build_lock(output):
            _remove_dead_builds(output)
            staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.building-", dir=output.parent))
            try:
                staging.chmod(0o755)  # mkdtemp's 0700 would make the engine private to its builder
                yield staging
                _check_complete(staging)
                _sync_tree(staging)
                _publish(staging, output)
            finally:
                shutil.rmtree(staging, ignore_errors=True)  # the failed build, or the engine it replaced
    except OSError as error:
        raise BuildError(_write_failure(output, error)) from error


def ensure_free_space(folder: Path, num_bytes: int, what: str) -> None:
    """Refuse, as a full disk, to write `what` (about `num_bytes`) where there is less room: for a
    writer that cannot fail cleanly (torch's .pt2 packager aborts the process on a full disk)."""
    free = shutil.disk_usage(folder).free  # what an unprivileged writer may still use
    if free < num_bytes:
        needed = f"about {num_bytes / 2**20:.0f} MiB needed, {free / 2**20:.1f} MiB free"
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} for {what}: {needed}")


def write_engine_json(folder: Path, config: EngineConfig) -> None:
    """Record the sha256 of every file already in `folder`, then write engine.json."""
    dataclasses.replace(config, artifacts=artifact_hashes(folder)).write(folder)


def _check_replaceable(output: Path) -> None:
    """Only an engine folder (or nothing) is replaced: `-o engines` by mistake must not delete
    every engine under it."""
    if output.exists() and not (output / ENGINE_JSON).is_file() and any(output.iterdir()):
        raise BuildError(f"{output} exists and is not an engine folder (no {ENGINE_JSON}); not replacing it")


@contextmanager
def _build_lock(output: Path) -> Iterator[None]:
    """Hold `.NAME.lock` beside `output` for the whole build. The file stays: unlinking a lock
    others may be waiting on would let two builds hold two different files."""
    lock = os.open(output.parent / f".{output.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another build of %s to finish", output)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)  # releases the lock; so does the kernel when a build is killed


def _remove_dead_builds(output: Path) -> None:
    """Under the lock no other build of `output` runs: every staging folder beside it is a killed
    build's, and a retired folder is an old engine a non-swapping publish was interrupted moving
    aside (restored if `output` is gone, else removed)."""
    for retired in sorted(output.parent.glob(f".{output.name}.old-*")):
        if not output.exists() and (retired / ENGINE_JSON).is_file():
            logger.warning("restoring %s from the interrupted build's %s", output, retired.name)
            retired.rename(output)
        else:
            shutil.rmtree(retired)
    for staging in sorted(output.parent.glob(f".{output.name}.building-*")):
        logger.info("removing %s, left by a build that did not finish", staging)
        shutil.rmtree(staging)


def _check_complete(staging: Path) -> None:
    """The staged folder must load as `ifb run` will load it, every sha256 checked (0.4 s for
    SmolLM2's 603 MB, from the page cache): an engine that would be refused is never published."""
    try:
        EngineConfig.load(staging, verify=True)
    except EngineFormatError as error:
        raise BuildError(f"the engine just built does not verify, so it was not published: {error}") from error


def _sync_tree(folder: Path) -> None:
    """fsync every file and folder, so a power cut after the rename cannot publish files the disk
    never received (ext4 and xfs may commit a rename before the data it names). Measured: 0.2 s
    for SmolLM2's 603 MB just written, which the page cache writes back anyway."""
    for path in [*sorted(folder.rglob("*")), folder]:
        _fsync(path)


def _publish(staging: Path, output: Path) -> None:
    """Put `staging` at `output`: a swap in one renameat2 where the file system has it (the old
    engine lands in `staging` and is removed with it), so no moment has no engine at `output`;
    else moved aside and replaced, two renames that `_remove_dead_builds` can undo."""
    if not output.exists():
        staging.rename(output)
    elif not _exchange(staging, output):
        retired = output.parent / staging.name.replace(".building-", ".old-")
        output.rename(retired)
        staging.rename(output)
        shutil.rmtree(retired, ignore_errors=True)
    _fsync(output.parent)  # the rename itself, on disk


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # not glibc >= 2.28
        return False
    result = renameat2(_AT_FDCWD, bytes(first), _AT_FDCWD, bytes(second), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):  # this file system cannot swap
        return False
    raise OSError(code, os.strerror(code), str(second))


def _fsync(path: Path) -> None:
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _write_failure(output: Path, error: OSError) -> str:
    where = f": {error.filename}" if error.filename else ""
    kept = "; the engine already there is unchanged" if (output / ENGINE_JSON).is_file() else ""
    return f"cannot build engine {output}: {error.strerror or error}{where}{kept}"
