"""The compile phase in a spawned process of its own.

Whatever export and AOTInductor keep alive after they return stays in the process that ran them:
a 1B Llama build held 1.3 GiB more after its compile phase than before it (gc and malloc_trim
freed nothing; most of it turned out to be AOTInductor's clones of buffers, see
QuantLinear.packed), so calibration, the build's last phase, started from 1.8 GiB and peaked at
2.6 GiB for a 0.62 GiB model. In a child process that memory goes when the child exits; the child
maps the weights file the pack phase wrote (NetworkRecipe), so no weights are copied between the two.
The child ends with the builder, however the builder ends (runtime/parent_watch.py); a
BuildError raised there is raised here.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ifb.builder.artifact_cache import ArtifactCache
from ifb.builder.backends import compiler_for
from ifb.builder.build_clock import peak_rss_bytes
from ifb.builder.compiled_step import CompiledStep
from ifb.builder.errors import BuildError
from ifb.builder.layer_chunk_plan import LayerChunking
from ifb.builder.network_recipe import NetworkRecipe
from ifb.builder.package_helper import PackageHelperProcess, helper_workers
from ifb.runtime.engine_format import BackendKind, EngineLimits, KernelLibraryInfo
from ifb.runtime.parent_watch import exit_with_parent
from ifb.runtime.step.kv_pool import engine_kv_pool


@dataclass(frozen=True)
class CompileJob:
    """What the compile process needs: it maps the weights file the pack phase wrote (NetworkRecipe).
    `reuse`: copy compiled code this machine's cache holds for the same graph (builder/artifact_cache.py)."""

    backend: BackendKind
    recipe: NetworkRecipe
    weights_path: Path
    limits: EngineLimits
    kv_dtype: str
    folder: Path
    reuse: bool
    chunking: LayerChunking = LayerChunking.AUTO


class CompileProcess:
    """The spawned process that runs the compile phase, started when the build starts: its start and
    imports (torch's compiler stack: 3.9-4.0 s on the quiet 2-core EPYC, 4.8-6.1 s beside a test
    run) then run on the other core while the parent reads and packs the file (3.4 s for SmolLM2),
    instead of after them."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=context,
            initializer=_start_child,
            initargs=(os.getpid(), logging.getLogger().getEffectiveLevel(), torch.get_num_threads()),
        )
        self._pool.submit(_import_compiler)  # the first job starts the process

    def compile(self, job: CompileJob) -> tuple[CompiledStep, int]:
        """Run the compile phase; the process ends with it, so the build's later phases do not share
        the machine's memory with what the compile left behind (the module docstring)."""
        try:
            return self._pool.submit(_compile, job).result()
        except BrokenProcessPool as error:
            raise BuildError(
                "the step compile process ended before compiling (killed, out of memory, or a script that "
                "builds engines at import: a spawned process imports the main module, so call the builder "
                "under `if __name__ == '__main__':`)"
            ) from error
        finally:
            self.close(wait=True)

    def close(self, wait: bool) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)


@contextmanager
def started_compile_process() -> Iterator[CompileProcess]:
    """A CompileProcess for the block. A build that fails does not wait for the process's imports to
    finish: the process ends on its own once they have (or with the builder, whichever is first)."""
    process = CompileProcess()
    try:
        yield process
    except BaseException:
        process.close(wait=False)
        raise
    process.close(wait=True)


def compile_in_child_process(
    backend: BackendKind,
    recipe: NetworkRecipe,
    weights_path: Path,
    limits: EngineLimits,
    kv_dtype: str,
    folder: Path,
    reuse: bool = True,
    process: CompileProcess | None = None,
    chunking: LayerChunking = LayerChunking.AUTO,
) -> tuple[CompiledStep, int]:
    """The compiled step, and the compile process's peak resident bytes, from `process` (started
    earlier) or a process of its own (CompileJob says what each argument is)."""
    job = CompileJob(backend, recipe, weights_path, limits, kv_dtype, folder, reuse, chunking)
    if process is not None:
        return process.compile(job)
    with started_compile_process() as own:
        return own.compile(job)


def _start_child(parent_pid: int, log_level: int, threads: int) -> None:
    exit_with_parent(parent_pid)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads)


def _import_compiler() -> None:
    """What every compile imports before its first step (the parent is reading the file meanwhile)."""
    import torch._inductor.compile_fx  # noqa: F401
    import torch.export  # noqa: F401


def _compile(job: CompileJob) -> tuple[CompiledStep, int]:
    network = job.recipe.load(job.weights_path)
    # The export's sample pools carry the pool dtype into the compiled step's input signature;
    # export never writes them, so they take no resident memory (kv_pool.py).
    kv_cache = engine_kv_pool(job.recipe.spec, job.limits, job.kv_dtype)
    helpers: list[PackageHelperProcess] = []

    def start_helper(kernels: KernelLibraryInfo | None) -> PackageHelperProcess:
        helpers.append(PackageHelperProcess(job, kernels))
        return helpers[-1]

    compiled = compiler_for(job.backend).compile(
        network,
        job.limits,
        kv_cache,
        job.folder,
        ArtifactCache(reuse=job.reuse),
        job.chunking,
        start_helper if helper_workers() > 1 else None,
    )
    # the helper ran beside this process: both peaks may have been at once
    return compiled, peak_rss_bytes() + sum(helper.peak_bytes for helper in helpers)


def refuse_in_spawned_bootstrap() -> None:
    """Raise if this is a spawned child still importing the main module: a script that builds at
    import would otherwise build again in every compile process it starts (and wait on its own
    build lock); Python's own check of this runs only when the child starts a process itself."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise BuildError(
            "an engine build started while a spawned process was importing the main module: call the "
            "builder under `if __name__ == '__main__':`"
        )
