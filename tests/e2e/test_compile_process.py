"""The build's compile phase runs in a spawned process of its own (builder/compile_process.py):
it ends with the builder however the builder ends, and a script that builds at import gets one
clear error instead of a build that waits on itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
from waiting import wait_until

COMPILE_CHILD = "multiprocessing.spawn"  # the compile process's command line


def build_command(source: Path, output: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ifb.cli.main",
        "build",
        str(source),
        "-o",
        str(output),
        "--max-batch-size",
        "2",
        "--max-num-tokens",
        "32",
        "--max-seq-len",
        "64",
        "--kv-blocks",
        "8",
    ]


def compile_children(builder: psutil.Process) -> list[psutil.Process]:
    found = []
    for child in builder.children(recursive=True):
        try:
            if COMPILE_CHILD in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def test_a_killed_builder_takes_its_compile_process_with_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    builder = subprocess.Popen(
        build_command(tiny_llama_dir, tmp_path / "engine"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        children = wait_until(lambda: compile_children(psutil.Process(builder.pid)), 300, "the compile process")
        os.kill(builder.pid, signal.SIGKILL)
        builder.wait(timeout=30)
        wait_until(lambda: not any(child.is_running() for child in children), 30, "the compile process to end")
    finally:
        if builder.poll() is None:
            builder.kill()


def test_a_script_that_builds_at_import_gets_an_error_not_a_hang(tiny_llama_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "no_main_guard.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from pathlib import Path
            from ifb.builder.build import BuildOptions, build_engine
            build_engine(Path({str(tiny_llama_dir)!r}), Path({str(tmp_path / "engine")!r}),
                         BuildOptions(max_batch_size=2, max_num_tokens=32, max_seq_len=64, kv_blocks=8))
            """
        )
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "if __name__ == '__main__':" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "engine").exists()


def test_a_build_that_fails_before_compiling_leaves_no_compile_process(tmp_path: Path) -> None:
    # the compile process starts with the build (its imports overlap the read and pack phases), so a
    # build refused in its read phase has one to end
    from ifb.builder.build import BuildOptions, build_engine
    from ifb.builder.errors import BuildError

    missing = tmp_path / "missing.gguf"
    try:
        build_engine(missing, tmp_path / "engine", BuildOptions(max_batch_size=2, max_seq_len=64))
    except (BuildError, FileNotFoundError, ValueError) as error:
        assert "missing.gguf" in str(error)
    else:
        raise AssertionError("a build of a missing file succeeded")
    wait_until(lambda: not compile_children(psutil.Process()), 120, "the compile process to end")
    assert not (tmp_path / "engine").exists()
