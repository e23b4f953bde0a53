"""PackageHelperProcess: a second spawned process that compiles some of a layer-chunked step's packages.

A package's compile is one Python process exporting and lowering (one core) and then g++ on its
wrapper and kernels; on the 2-core EPYC two package compiles at once had 1.4x the throughput of
one (stop 56). So where the plan has packages enough (layer_chunk_plan.split_packages), the compile
process starts this helper, which maps the same weights file (no weights are copied), loads the
engine's kernel library, and compiles the packages it is given into the same folder and compile
cache. It ends with the compile process, however that ends (runtime/parent_watch.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ifb.builder.artifact_cache import ArtifactCache
from ifb.builder.build_clock import peak_rss_bytes
from ifb.builder.compile_cpu import PackageTask, compile_package_task
from ifb.runtime.engine_format import KernelLibraryInfo
from ifb.runtime.parent_watch import exit_with_parent
from ifb.runtime.step.kernels import ensure_quant_library
from ifb.runtime.step.kv_pool import engine_kv_pool
from ifb.runtime.step.network import StepNetwork

if TYPE_CHECKING:
    from ifb.builder.compile_process import CompileJob


@dataclass
class _HelperState:
    job: CompileJob
    network: StepNetwork
    kv_cache: torch.Tensor
    kernels: KernelLibraryInfo | None


_STATE: list[_HelperState] = []  # the helper process's network, set once by its initializer


class PackageHelperProcess:
    """The helper (module docstring) for one compile: `submit` queues a package, `close` ends it;
    `peak_bytes`: its resident high-water mark as its last finished package reported it."""

    def __init__(self, job: CompileJob, kernels: KernelLibraryInfo | None) -> None:
        self.peak_bytes = 0
        self._pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_helper,
            initargs=(os.getpid(), logging.getLogger().getEffectiveLevel(), torch.get_num_threads(), job, kernels),
        )

    def submit(self, task: PackageTask) -> Future[tuple[bool, int]]:
        future = self._pool.submit(_compile_task, task)
        future.add_done_callback(self._record_peak)
        return future

    def _record_peak(self, future: Future[tuple[bool, int]]) -> None:
        if not future.cancelled() and future.exception() is None:
            self.peak_bytes = max(self.peak_bytes, future.result()[1])

    def close(self, wait: bool) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)


def helper_workers() -> int:
    """Processes that may compile packages at once here: a helper only where there is a second core."""
    return 2 if len(os.sched_getaffinity(0)) >= 2 else 1


def _start_helper(
    parent_pid: int, log_level: int, threads: int, job: CompileJob, kernels: KernelLibraryInfo | None
) -> None:
    exit_with_parent(parent_pid)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads)
    if kernels is not None:  # the packed weights' ops must be loaded before export
        ensure_quant_library(job.folder / kernels.path, kernels.isa, kernels.cpu_features)
    network = job.recipe.load(job.weights_path)
    kv_cache = engine_kv_pool(job.recipe.spec, job.limits, job.kv_dtype)
    _STATE.append(_HelperState(job, network, kv_cache, kernels))


def _compile_task(task: PackageTask) -> tuple[bool, int]:
    state = _STATE[0]
    cache = ArtifactCache(reuse=state.job.reuse)
    reused = compile_package_task(
        state.network, task, state.job.limits, state.kv_cache, state.job.folder, cache, state.kernels
    )
    return reused, peak_rss_bytes()
