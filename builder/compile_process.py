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
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch

from ifb.builder.artifact_cache import ArtifactCache
from ifb.builder.backends import compiler_for
from ifb.builder.build_clock import peak_rss_bytes
from ifb.builder.compiled_step import CompiledStep
from ifb.builder.errors import BuildError
from ifb.builder.network_recipe import NetworkRecipe
from ifb.runtime.engine_format import BackendKind, EngineLimits
from ifb.runtime.parent_watch import exit_with_parent
from ifb.runtime.step.kv_pool import engine_kv_pool


def compile_in_child_process(
    backend: BackendKind,
    recipe: NetworkRecipe,
    weights_path: Path,
    limits: EngineLimits,
    kv_dtype: str,
    folder: Path,
    reuse: bool = True,
) -> tuple[CompiledStep, int]:
    """The compiled step, and the compile process's peak resident bytes. `reuse`: copy compiled
    code this machine's cache holds for the same graph (builder/artifact_cache.py)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=1,
        mp_context=context,
        initializer=_start_child,
        initargs=(os.getpid(), logging.getLogger().getEffectiveLevel(), torch.get_num_threads()),
    ) as pool:
        try:
            return pool.submit(_compile, backend, recipe, weights_path, limits, kv_dtype, folder, reuse).result()
        except BrokenProcessPool as error:
            raise BuildError(
                "the step compile process ended before compiling (killed, out of memory, or a script that "
                "builds engines at import: a spawned process imports the main module, so call the builder "
                "under `if __name__ == '__main__':`)"
            ) from error


def _start_child(parent_pid: int, log_level: int, threads: int) -> None:
    exit_with_parent(parent_pid)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads)


def _compile(
    backend: BackendKind,
    recipe: NetworkRecipe,
    weights_path: Path,
    limits: EngineLimits,
    kv_dtype: str,
    folder: Path,
    reuse: bool,
) -> tuple[CompiledStep, int]:
    network = recipe.load(weights_path)
    # The export's sample pools carry the pool dtype into the compiled step's input signature;
    # export never writes them, so they take no resident memory (kv_pool.py).
    kv_cache = engine_kv_pool(recipe.spec, limits, kv_dtype)
    compiled = compiler_for(backend).compile(network, limits, kv_cache, folder, ArtifactCache(reuse=reuse))
    return compiled, peak_rss_bytes()


def refuse_in_spawned_bootstrap() -> None:
    """Raise if this is a spawned child still importing the main module: a script that builds at
    import would otherwise build again in every compile process it starts (and wait on its own
    build lock); Python's own check of this runs only when the child starts a process itself."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise BuildError(
            "an engine build started while a spawned process was importing the main module: call the "
            "builder under `if __name__ == '__main__':`"
        )
