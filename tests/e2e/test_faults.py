"""The fault suite: a damaged engine folder is refused at load naming the file, and a build that
hits a full or read-only disk, or is killed, leaves the engine already at its path untouched.

Load faults damage a copy of the session's tiny engine and load it through `LLM(...)`, `ifb run`
in-process and `ifb run` as a real process (its stderr must hold one `Error:` line and no
traceback). Build faults put a copy at the output path first and compare every file's sha256
afterwards. A full disk is injected into the weights writer everywhere, and made real where this
machine lets an unprivileged user namespace mount a small tmpfs (`unshare -rm`); a read-only
folder is a chmod (skipped as root, which ignores it) and, where tmpfs works, a read-only mount.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import TINY_LIMITS

from ifb.builder import engine_writer
from ifb.builder.build import BuildOptions, build_engine
from ifb.builder.engine_writer import atomic_engine_folder
from ifb.builder.errors import BuildError
from ifb.cli.main import cli
from ifb.llm import LLM
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.engine_format.weights_file import WeightsWriter
from ifb.runtime.errors import EngineFormatError

BUILD_FLAGS = [f"--{name.replace('_', '-')}={value}" for name, value in TINY_LIMITS.items()]
BUILD_FLAGS += ["--dtype=fp32", "--compute=fp32"]
IFB = [sys.executable, "-m", "ifb.cli.main"]


pytestmark = pytest.mark.usefixtures("restore_root_logger")  # the CLI configures the root logger


# -- damage ---------------------------------------------------------------------------------------
def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def not_utf8(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[10] = 0xFF  # inside the first key: still the right length, no longer text
    path.write_bytes(bytes(data))


def change_a_limit(path: Path) -> None:
    """Valid JSON that parses into a good-looking record: one more seat than the step was built for."""
    text = path.read_text()
    assert '"max_batch_size": 8' in text
    path.write_text(text.replace('"max_batch_size": 8', '"max_batch_size": 9', 1))


@dataclass(frozen=True, slots=True)
class Fault:
    file: str
    damage: Callable[[Path], None]
    expected: str  # a regex the one-line error must match

    def apply(self, engine: Path) -> Path:
        self.damage(engine / self.file)
        return engine


def corrupted(file: str, damage: Callable[[Path], None] = flip_byte) -> Fault:
    return Fault(file, damage, rf"{re.escape(file)}.*corrupted.*sha256")


def missing(file: str) -> Fault:
    return Fault(file, Path.unlink, rf"{re.escape(file)}.*missing")


FAULTS = {
    "weights-flipped": corrupted("weights.safetensors"),
    "weights-truncated": corrupted("weights.safetensors", cut_in_half),
    "weights-missing": missing("weights.safetensors"),
    "step-flipped": corrupted("step.pt2"),
    "step-truncated": corrupted("step.pt2", cut_in_half),
    "step-missing": missing("step.pt2"),
    "tokenizer-flipped": corrupted("tokenizer/tokenizer.json"),
    "tokenizer-config-missing": missing("tokenizer/tokenizer_config.json"),
    "engine-json-truncated": Fault("engine.json", cut_in_half, r"engine\.json is not valid JSON"),
    "engine-json-empty": Fault("engine.json", lambda p: p.write_bytes(b""), r"engine\.json is not valid JSON"),
    "engine-json-not-utf8": Fault("engine.json", not_utf8, r"engine\.json is not valid JSON.*utf-8"),
    "engine-json-value-changed": Fault("engine.json", change_a_limit, r"engine\.json.*corrupted.*sha256"),
    "engine-json-missing": Fault("engine.json", Path.unlink, r"engine\.json is missing"),
}


@pytest.fixture()
def engine_copy(tiny_llama_engine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_llama_engine, tmp_path / "engine"))


def assert_one_line(message: str, expected: str) -> None:
    assert re.search(expected, message, re.IGNORECASE), message
    assert "\n" not in message.strip(), message


# -- load -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
def test_damaged_engine_is_refused_at_load_naming_the_file(fault: Fault, engine_copy: Path) -> None:
    """LLM(...) raises EngineFormatError before a step exists: no crash inside the step."""
    with pytest.raises(EngineFormatError) as caught:
        LLM(fault.apply(engine_copy))
    assert_one_line(str(caught.value), fault.expected)


@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
def test_ifb_run_refuses_a_damaged_engine_in_one_line(fault: Fault, engine_copy: Path) -> None:
    result = CliRunner().invoke(cli, ["run", str(fault.apply(engine_copy)), "--prompt", "hi"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output.startswith("Error: "), result.output
    assert_one_line(result.output, fault.expected)


@pytest.mark.parametrize("name", ["weights-flipped", "engine-json-not-utf8", "engine-json-missing"])
def test_ifb_run_process_prints_one_error_line_and_no_traceback(name: str, engine_copy: Path) -> None:
    fault = FAULTS[name]
    ran = subprocess.run([*IFB, "run", str(fault.apply(engine_copy)), "--prompt", "hi"], capture_output=True, text=True)
    assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr
    errors = [line for line in ran.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, ran.stderr
    assert_one_line(errors[0], fault.expected)


# -- build: the engine at the output path survives -----------------------------------------------
def tree_hashes(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def temporary_folders(output: Path) -> list[str]:
    """Build folders beside `output`: the staging (and retired) folders of its builds."""
    return sorted(p.name for p in output.parent.iterdir() if p.is_dir() and p.name.startswith(f".{output.name}."))


@pytest.fixture()
def previous(tiny_llama_engine: Path, tmp_path: Path) -> Path:
    """An engine already at the output path (engines/tiny), as a rebuild finds it."""
    return Path(shutil.copytree(tiny_llama_engine, tmp_path / "engines" / "tiny"))


@pytest.fixture()
def disk_fills(monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights writer's second tensor meets a full disk: the file is half-written."""
    original = WeightsWriter.write
    calls: list[str] = []

    def write(self: WeightsWriter, name: str, tensor: object) -> None:
        calls.append(name)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        original(self, name, tensor)  # type: ignore[arg-type]

    monkeypatch.setattr(WeightsWriter, "write", write)


def build_cli(source: Path, output: Path) -> list[str]:
    return ["build", str(source), "-o", str(output), *BUILD_FLAGS]


@pytest.mark.usefixtures("disk_fills")
def test_disk_full_midway_fails_in_one_line_and_keeps_the_previous_engine(tiny_llama_dir: Path, previous: Path) -> None:
    before = tree_hashes(previous)
    result = CliRunner().invoke(cli, build_cli(tiny_llama_dir, previous))
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert str(previous) in errors[0] and "no space left on device" in errors[0].lower(), errors[0]
    assert tree_hashes(previous) == before and temporary_folders(previous) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores a folder's permissions")
def test_read_only_engines_folder_fails_in_one_line(tiny_llama_dir: Path, previous: Path) -> None:
    before = tree_hashes(previous)
    previous.parent.chmod(0o555)
    try:
        result = CliRunner().invoke(cli, build_cli(tiny_llama_dir, previous))
    finally:
        previous.parent.chmod(0o755)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert str(previous) in result.output and "permission denied" in result.output.lower(), result.output
    assert tree_hashes(previous) == before and temporary_folders(previous) == []


# -- build on a real small or read-only file system (tmpfs in a user namespace) -------------------
@functools.cache
def can_mount_tmpfs(where: str) -> bool:
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {where}"], capture_output=True
    )
    return probe.returncode == 0


@dataclass(frozen=True, slots=True)
class MountedBuild:
    returncode: int
    stderr: str
    hashes: dict[str, str]  # every file on the mount afterwards, by path from the mount
    entries: list[str]  # what the mount's top folder holds afterwards


def kib_on_tmpfs(path: Path) -> int:
    """What a file, or a folder's files, take on a tmpfs: whole 4 KiB pages."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(-(-p.stat().st_size // 4096) * 4 for p in files)


def build_on_tmpfs(tmp_path: Path, source: Path, previous: Path, size_kib: int, read_only: bool) -> MountedBuild:
    """`ifb build` over a copy of `previous` on a tmpfs of `size_kib` (remounted read-only
    first if asked); the mount lives only in the namespace, so it is inspected from inside."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    if not can_mount_tmpfs(str(mount)):
        pytest.skip("this machine cannot mount a tmpfs in a user namespace (unshare -rm)")
    stderr, report = tmp_path / "stderr.txt", tmp_path / "report.txt"
    script = " && ".join(
        [
            f"mount -t tmpfs -o size={size_kib}k tmpfs {mount}",
            f"cp -a {previous} {mount}/tiny",
            *([f"mount -o remount,ro {mount}"] if read_only else []),
            f"{{ {' '.join(IFB)} {' '.join(build_cli(source, mount / 'tiny'))} 2>{stderr}; echo $? > {report}; }}",
            f"(cd {mount} && find . -type f -exec sha256sum {{}} + >> {report}; ls -A > {tmp_path / 'entries.txt'})",
        ]
    )
    subprocess.run(["unshare", "-rm", "sh", "-c", script], check=True, timeout=300)
    returncode, *lines = report.read_text().splitlines()
    hashes = {path.removeprefix("./"): digest for digest, path in (line.split(maxsplit=1) for line in lines)}
    entries = (tmp_path / "entries.txt").read_text().split()
    return MountedBuild(int(returncode), stderr.read_text(), hashes, entries)


def assert_failed_cleanly(build: MountedBuild, before: dict[str, str], cause: str) -> None:
    assert build.returncode == 1 and "Traceback" not in build.stderr, build.stderr[-3000:]
    errors = [line for line in build.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and cause in errors[0].lower(), build.stderr[-3000:]
    kept = {path.removeprefix("tiny/"): digest for path, digest in build.hashes.items() if path.startswith("tiny/")}
    assert kept == before
    assert set(build.entries) <= {"tiny", ".tiny.lock"}, build.entries  # no staging folder left


@pytest.mark.parametrize("stage", ["weights", "step"])
def test_a_really_full_disk_fails_in_one_line_and_keeps_the_previous_engine(
    stage: str, tiny_llama_dir: Path, previous: Path, tmp_path: Path
) -> None:
    """weights: the disk fills while weights.safetensors is written (our writer); step: the
    weights fit but step.pt2 would not (torch's packager aborts the process on a full disk, so
    the build must refuse before calling it)."""
    before = tree_hashes(previous)
    room = 128 if stage == "weights" else kib_on_tmpfs(previous / "weights.safetensors") + 256
    build = build_on_tmpfs(tmp_path, tiny_llama_dir, previous, kib_on_tmpfs(previous) + room, read_only=False)
    assert_failed_cleanly(build, before, "no space left on device")


def test_a_read_only_mount_fails_in_one_line_and_keeps_the_previous_engine(
    tiny_llama_dir: Path, previous: Path, tmp_path: Path
) -> None:
    before = tree_hashes(previous)
    build = build_on_tmpfs(tmp_path, tiny_llama_dir, previous, kib_on_tmpfs(previous) + 4096, read_only=True)
    assert_failed_cleanly(build, before, "read-only file system")


# -- build killed ----------------------------------------------------------------------------------
def wait_for_staged(output: Path, file: str, builder: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not list(output.parent.glob(f".{output.name}.building-*/{file}")):
        assert builder.poll() is None and time.monotonic() < deadline, "the build never staged " + file
        time.sleep(0.02)


def test_sigkill_mid_build_leaves_the_previous_engine_and_the_next_build_clears_the_rest(
    tiny_llama_dir: Path, previous: Path, disk_fills: None
) -> None:
    """Killed once it writes the weights: the old engine still loads as itself; what is left beside
    it is a dot-folder named as a build's staging, no engine (nothing to load), and the next build
    of that path removes it, even one that fails."""
    before, build_id = tree_hashes(previous), EngineConfig.load(previous).build_id
    command = [*IFB, *build_cli(tiny_llama_dir, previous)]
    builder = subprocess.Popen(command, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_staged(previous, "weights.safetensors", builder)
    finally:
        os.killpg(builder.pid, signal.SIGKILL)  # the build's own process group: it and any helper
        builder.wait()
    assert tree_hashes(previous) == before and EngineConfig.load(previous).build_id == build_id
    left = temporary_folders(previous)
    assert left and all(name.startswith(".tiny.building-") for name in left), left
    with pytest.raises(EngineFormatError, match="engine.json is missing"):
        EngineConfig.load(previous.parent / left[0])
    with pytest.raises(BuildError, match="No space left on device"):
        build_engine(tiny_llama_dir, previous, BuildOptions(dtype="fp32", compute="fp32", **TINY_LIMITS))
    assert temporary_folders(previous) == [] and tree_hashes(previous) == before


# -- the writer itself: publish only a complete, verified engine, and only over an engine ----------
def test_a_staged_engine_that_does_not_verify_is_not_published(previous: Path) -> None:
    before = tree_hashes(previous)
    with pytest.raises(BuildError, match="weights.safetensors.*corrupted"):
        with atomic_engine_folder(previous) as staging:
            shutil.copytree(previous, staging, dirs_exist_ok=True)
            flip_byte(staging / "weights.safetensors")
    assert tree_hashes(previous) == before and temporary_folders(previous) == []


def test_a_new_engine_replaces_the_old_one_whole(previous: Path) -> None:
    config = EngineConfig.load(previous)
    with atomic_engine_folder(previous) as staging:
        shutil.copytree(previous, staging, dirs_exist_ok=True)
        dataclasses.replace(config, build_id="new").write(staging)
    assert EngineConfig.load(previous).build_id == "new" and temporary_folders(previous) == []


def test_without_a_swap_the_new_engine_still_replaces_the_old_one(
    previous: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system without renameat2's exchange: moved aside, replaced, the old one removed."""
    monkeypatch.setattr(engine_writer, "_exchange", lambda first, second: False)
    test_a_new_engine_replaces_the_old_one_whole(previous)


def test_a_publish_killed_between_its_two_renames_is_undone_by_the_next_build(previous: Path) -> None:
    """Killed after moving the old engine aside, before the new one took its place: the next
    build of the path finds no engine there and puts the old one back."""
    before = tree_hashes(previous)
    (previous.parent / ".tiny.building-x1").mkdir()
    previous.rename(previous.parent / ".tiny.old-x1")
    with pytest.raises(BuildError, match="stop here"), atomic_engine_folder(previous):
        raise BuildError("stop here")
    assert tree_hashes(previous) == before and temporary_folders(previous) == []


def test_a_folder_that_is_not_an_engine_is_never_replaced(tmp_path: Path) -> None:
    """`ifb build -o engines` by mistake must not delete every engine under it."""
    output = tmp_path / "engines"
    (output / "other-engine").mkdir(parents=True)
    (output / "notes.txt").write_text("keep me\n")
    with pytest.raises(BuildError, match="not an engine folder"):
        with atomic_engine_folder(output):
            pytest.fail("the build must be refused before it starts")
    assert (output / "notes.txt").read_text() == "keep me\n" and (output / "other-engine").is_dir()
