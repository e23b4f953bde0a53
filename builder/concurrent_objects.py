"""concurrent_object_builds(): AOTInductor's wrapper and kernel objects compiled at the same time.

torch 2.13's AotCodeCompiler compiles a step package's `.wrapper.cpp` and then its `.kernel.cpp`,
one after the other, then links the two objects. Neither compile reads the other's output, and
the build's own process only waits meanwhile: for SmolLM2's 30 layers on the 2-core AVX2 EPYC
the wrapper took 15.6 s (-O1, one 2,000-line function) and the kernels 2.0 s (-O3), so the
kernels' compiler runs on the second core while the wrapper's runs.

Inside the context, a wrapper object's build starts its compiler in the background and returns;
the next build (the kernels', then the link) runs and then waits for it; a link waits before it
runs, since it reads the objects. A failed compile raises torch's own CppCompileError with the
compiler's output, as a plain build does.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from torch._inductor import cpp_builder

# torch._inductor is imported where it is used: the build's own process imports this module (through
# compile_cpu) but never compiles, and importing torch._inductor there cost 1.5 s of its start.

logger = logging.getLogger(__name__)

WRAPPER_OBJECT_SUFFIX = ".wrapper.o"


@dataclass
class BackgroundCompile:
    """One compiler process started by a wrapper object's build, and where its output goes."""

    command: list[str]
    process: subprocess.Popen[bytes]
    output: IO[bytes]
    scratch: Path

    @classmethod
    def start(cls, builder: cpp_builder.CppBuilder) -> BackgroundCompile:
        """As CppBuilder.build runs its command (in a scratch folder beside the output), not waited for."""
        target = Path(builder.get_target_file_path())
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"{target.stem}-", dir=target.parent))
        command = shlex.split(builder.get_command_line())
        output = tempfile.TemporaryFile()
        process = subprocess.Popen(command, cwd=scratch, stdout=output, stderr=subprocess.STDOUT)
        logger.debug("compiling %s in the background", target.name)
        return cls(command, process, output, scratch)

    def finish(self) -> None:
        """Wait for the compiler; CppCompileError with its output if it failed."""
        try:
            code = self.process.wait()
            if code != 0:
                from torch._inductor.exc import CppCompileError

                self.output.seek(0)
                raise CppCompileError(self.command, self.output.read().decode(errors="replace"))
        finally:
            self.output.close()
            shutil.rmtree(self.scratch, ignore_errors=True)

    def abandon(self) -> None:
        """The build failed elsewhere: stop the compiler rather than leave it running."""
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(Exception):  # its output is not what failed the build
            self.finish()


def _is_wrapper_object(builder: cpp_builder.CppBuilder) -> bool:
    compile_only = getattr(builder, "_compile_only", False)  # a private field: torch is pinned (2.13)
    return bool(compile_only) and builder.get_target_file_path().endswith(WRAPPER_OBJECT_SUFFIX)


@contextlib.contextmanager
def concurrent_object_builds() -> Iterator[None]:
    """Every CppBuilder.build inside runs as described in the module docstring."""
    from torch._inductor import cpp_builder

    original = cpp_builder.CppBuilder.build
    pending: list[BackgroundCompile] = []

    def finish_pending() -> None:
        while pending:
            pending.pop(0).finish()

    def build(builder: cpp_builder.CppBuilder) -> None:
        if _is_wrapper_object(builder):
            pending.append(BackgroundCompile.start(builder))
            return
        if not getattr(builder, "_compile_only", False):
            finish_pending()  # a link reads the objects
        original(builder)
        finish_pending()

    cpp_builder.CppBuilder.build = build  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        cpp_builder.CppBuilder.build = original  # type: ignore[method-assign]
        for job in pending:
            job.abandon()
