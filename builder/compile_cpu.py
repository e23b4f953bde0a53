"""The CPU backend: export the step network with bounded dynamic shapes, compile it ahead of time.

AOTInductor with freezing turns the network into a shared library whose weights are constants
prepacked for this CPU's matrix units (oneDNN/AMX for bf16); `ifb run` loads the package
without recompiling.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ifb.builder.artifact_cache import ArtifactCache, ArtifactKey
from ifb.builder.concurrent_objects import concurrent_object_builds
from ifb.builder.layer_chunk_plan import ChunkPlan, package_seconds, split_packages
from ifb.builder.step_export import dynamic_shapes, sample_args, sample_step_inputs
from ifb.plugins import quant_ops
from ifb.plugins.quant_build import (
    QuantIsa,
    best_isa,
    build_quant_library,
    cpu_features,
    isa_features,
    library_fingerprint,
    library_name,
)
from ifb.runtime.engine_format import EngineLimits, KernelLibraryInfo, LayerChunk
from ifb.runtime.step.engine import kv_pool_views
from ifb.runtime.step.kernels import ensure_quant_library
from ifb.runtime.step.layer_chunks import HeadNetwork, LayerChunkNetwork
from ifb.runtime.step.network import StepNetwork

logger = logging.getLogger(__name__)

# Freezing folds the weights in as constants and prepacks them (MKL for fp32, oneDNN for bf16).
# max_autotune with Inductor's C++ GEMM templates was measured too: on the full SmolLM2 step it
# picked kernels no faster than the packed MKL ones (decode b1/b8/b32: 23/47/147 ms vs
# 26/44/133 ms) and added a minute of compile, so it stays off.
INDUCTOR_CONFIGS: dict[str, object] = {
    "freezing": True,
    # The fusion search pairs every node with the next 64 that read the same buffer; the step's
    # per-step inputs (slots, query rows, rope tables) are read by every layer, so most pairs span
    # layers and cannot fuse (layer i+1 depends on layer i). Nodes of one layer that share a buffer
    # are a few apart in it.
    "max_fusion_buffer_group_pairwise_attempts": 8,
    # The wrapper's per-call shape checks run only under AOTI_RUNTIME_CHECK_INPUTS, yet g++ compiles
    # them every build; the line tables serve native profilers, which a build does not need.
    "size_asserts": False,
    "aot_inductor.enable_line_tables": False,
}
KERNELS_DIR = "kernels"
LAYERS_PACKAGE_PREFIX = "layers-"  # a layer-chunked step's packages: layers-0.pt2, ..., head.pt2
HEAD_PACKAGE = "head.pt2"


def kernel_library_key(isa: QuantIsa) -> ArtifactKey:
    """The compile cache's key of the kernel library for `isa`: its sources, flags, compiler and torch."""
    return ArtifactKey.of("kernels", library_fingerprint(isa))


def prepare_kernel_library(cache: ArtifactCache) -> tuple[QuantIsa, bool]:
    """Compile this CPU's kernel library into `cache` unless it holds a sound copy already (`ifb
    kernels`, which `make install` runs): it does not depend on any model, and compiling it was 30.6
    s of the 81 s compile phase of a first SmolLM2 build on 2 quiet cores (py-spy). Returns its ISA
    and whether it was compiled now."""
    isa = best_isa(cpu_features())
    with tempfile.TemporaryDirectory(prefix="ifb-quant-") as scratch:
        reused = _library_at(Path(scratch) / library_name(isa), isa, cache)
    return isa, not reused


def build_engine_kernels(folder: Path, cache: ArtifactCache | None) -> tuple[KernelLibraryInfo, bool]:
    """Compile the block-quantized matmul library into `folder`/kernels (or copy the one `cache`
    holds for the same sources, flags, compiler and ISA) and load it here: it must be loaded before
    export, and the compiled model library links its C shim. Also says whether it was reused."""
    isa = best_isa(cpu_features())
    (folder / KERNELS_DIR).mkdir()
    target = folder / KERNELS_DIR / library_name(isa)
    reused = _library_at(target, isa, cache)
    ensure_quant_library(target, isa.value, isa_features(isa))
    logger.info("%s %s (%s)", "reused" if reused else "built", target.name, isa.value)
    return KernelLibraryInfo(f"{KERNELS_DIR}/{target.name}", isa.value, isa_features(isa)), reused


def _library_at(target: Path, isa: QuantIsa, cache: ArtifactCache | None) -> bool:
    """The kernel library for `isa` at `target`: the copy `cache` holds (its checksum checked), or
    compiled now (object files in a scratch folder) and stored there. Returns whether it was reused."""
    key = kernel_library_key(isa)
    if cache is not None and cache.fetch(key, target):
        return True
    with tempfile.TemporaryDirectory(prefix="ifb-quant-") as scratch:
        library = build_quant_library(Path(scratch), isa)
        shutil.copyfile(library.path, target)
    if cache is not None:
        cache.store(key, target)
    return False


def compile_cpu_engine(
    network: StepNetwork,
    limits: EngineLimits,
    kv_cache: torch.Tensor,
    package_path: Path,
    constants_in_package: bool = True,
    cache: ArtifactCache | None = None,
    kernels: KernelLibraryInfo | None = None,
) -> bool:
    """Export and AOT-compile `network` into a .pt2 package at `package_path` (any packed weight's
    op must be loaded already: see `build_engine_kernels`). Without `constants_in_package` the
    library holds no weights: the runtime binds them by name (AotiStep), and compiling does not
    serialize a second copy of them (for a 1B model that copy alone is the size of the file).
    Such a package depends on the exported graph only, so `cache` may hold it already (from a
    build of another file of the same shapes): returns whether it was reused."""
    shapes = dynamic_shapes(limits, 2 * kv_cache.shape[0])
    configs = compile_configs(network, constants_in_package)
    return compile_package(network, sample_args(limits, kv_cache), shapes, package_path, configs, cache, kernels)


@dataclass(frozen=True, slots=True)
class PackageTask:
    """One package of a layer-chunked step: layers [first, first + count) of the network, or the
    head's (count 0), written to `file_name` in the engine folder."""

    file_name: str
    first: int = 0
    count: int = 0


class PackageHelper(Protocol):
    """A process that compiles packages beside this one (builder/package_helper.py): `submit`
    returns whether the cache held the package, and the helper's peak resident bytes."""

    def submit(self, task: PackageTask) -> Future[tuple[bool, int]]: ...

    def close(self, wait: bool) -> None: ...


HelperFactory = Callable[[KernelLibraryInfo | None], PackageHelper]


def compile_layer_chunks(
    network: StepNetwork,
    plan: ChunkPlan,
    limits: EngineLimits,
    kv_cache: torch.Tensor,
    folder: Path,
    cache: ArtifactCache | None,
    kernels: KernelLibraryInfo | None,
    start_helper: HelperFactory | None = None,
) -> tuple[tuple[LayerChunk, ...], str, int]:
    """A weightless package per distinct chunk of `plan` and one for the head, in `folder`
    (runtime/step/layer_chunks.py), some of them in a helper process where `start_helper` is given
    and layer_chunk_plan.split_packages says so. Returns the chunks, the head's package and how many
    of the packages `cache` held."""
    names: dict[int, str] = {}
    tasks: list[PackageTask] = []
    for (first, count), package in zip(plan.chunks, plan.packages, strict=True):
        if package not in names:
            names[package] = f"{LAYERS_PACKAGE_PREFIX}{package}.pt2"
            tasks.append(PackageTask(names[package], first, count))
    tasks.append(PackageTask(HEAD_PACKAGE))  # package_seconds' order: the distinct chunks, then the head
    mine, theirs = split_packages(package_seconds(plan), 2 if start_helper is not None else 1)
    helper = start_helper(kernels) if start_helper is not None and theirs else None
    pending = [(tasks[index], helper.submit(tasks[index])) for index in theirs] if helper is not None else []
    if helper is not None:
        logger.info("compiling %s in a helper process", [tasks[index].file_name for index in theirs])
    try:
        reused = sum(compile_package_task(network, tasks[i], limits, kv_cache, folder, cache, kernels) for i in mine)
        for task, future in pending:
            try:
                task_reused, _ = future.result()
            except BrokenProcessPool:
                logger.warning("the helper process ended before compiling %s: compiling it here", task.file_name)
                task_reused = compile_package_task(network, task, limits, kv_cache, folder, cache, kernels)
            reused += task_reused
    except BaseException:
        if helper is not None:  # not waited for: it ends with this process (package_helper.py)
            helper.close(wait=False)
        raise
    if helper is not None:
        helper.close(wait=True)
    chunks = tuple(
        LayerChunk(names[package], first, count)
        for (first, count), package in zip(plan.chunks, plan.packages, strict=True)
    )
    return chunks, HEAD_PACKAGE, reused


def compile_package_task(
    network: StepNetwork,
    task: PackageTask,
    limits: EngineLimits,
    kv_cache: torch.Tensor,
    folder: Path,
    cache: ArtifactCache | None,
    kernels: KernelLibraryInfo | None,
) -> bool:
    """Compile `task`'s package of `network` into `folder` (or copy it from `cache`); returns
    whether it was reused."""
    configs = compile_configs(network, constants_in_package=False)
    step = sample_step_inputs(limits)
    shapes = dynamic_shapes(limits, 0)
    with torch.no_grad():
        hidden = network.embed_tokens(step.input_ids)  # the chunks' sample input, of the step's dtype
    module: torch.nn.Module
    if task.count == 0:
        module, sample, task_shapes = HeadNetwork(network), (hidden, step.logits_indices), (shapes[0], shapes[-2])
    else:
        module = LayerChunkNetwork(network, task.first, task.count)
        sample = (hidden, *step.as_args()[1:-1], kv_pool_views(kv_cache)[: 2 * task.count])
        task_shapes = (shapes[0], *shapes[1:-2], [None] * (2 * task.count))
    return compile_package(module, sample, task_shapes, folder / task.file_name, configs, cache, kernels)


def compile_configs(network: StepNetwork, constants_in_package: bool) -> dict[str, object]:
    return {
        **INDUCTOR_CONFIGS,
        **(quant_ops.aoti_configs() if network.weight_formats else {}),
        "aot_inductor.package_constants_in_so": constants_in_package,
        # Freezing makes new constants (prepacked dense weights, `_frozen_param*`) that no
        # weights file holds; weights bound at load must stay the network's own tensors.
        "freezing": constants_in_package,
        "emulate_precision_casts": computes_in_low_precision(network),
    }


def compile_package(
    module: torch.nn.Module,
    sample: tuple[object, ...],
    shapes: tuple[object, ...],
    package_path: Path,
    configs: dict[str, object],
    cache: ArtifactCache | None,
    kernels: KernelLibraryInfo | None,
) -> bool:
    """Export `module` on `sample` with `shapes` and AOT-compile it into `package_path`, or copy
    what `cache` holds for the same exported graph (weightless packages only: one holding weights
    depends on their values). Returns whether it was reused."""
    module.eval()
    with torch.no_grad():
        exported = torch.export.export(module, sample, dynamic_shapes=shapes)
        logger.info("exported %s with %d nodes", package_path.name, len(exported.graph.nodes))
        weightless = not configs["aot_inductor.package_constants_in_so"]
        key = step_key(exported, configs, kernels) if weightless and cache is not None else None
        if key is not None and cache is not None and cache.fetch(key, package_path):
            logger.info("reused the compiled %s for this graph from %s", package_path.name, cache.root)
            return True
        with concurrent_object_builds():
            torch._inductor.aoti_compile_and_package(exported, package_path=str(package_path), inductor_configs=configs)
    if key is not None and cache is not None:
        cache.store(key, package_path)
    return False


def computes_in_low_precision(network: StepNetwork) -> bool:
    """Whether the step computes in bf16 or fp16. Inductor then computes a fused chain of such ops
    in fp32 and rounds once at the end, where eager (and transformers) round after every op; with
    the context and decode rows in one attention call, that once moved a bf16 Qwen3 MoE's greedy
    token off transformers' (token 163's logit 11.5 eager, 12.125 compiled). Inductor's
    `emulate_precision_casts` rounds where eager rounds; fp32 steps have nothing to round."""
    return any(tensor.dtype in (torch.bfloat16, torch.float16) for tensor in network.parameters())


def step_key(
    exported: torch.export.ExportedProgram, configs: dict[str, object], kernels: KernelLibraryInfo | None
) -> ArtifactKey:
    """What a weightless step package's bytes depend on: the exported graph with every node's
    shape, dtype and stride, its signature (the constants' names, which the runtime binds by) and
    shape ranges, the values of tensors the graph itself holds (lifted constants), the compile
    configs, torch, and the CPU Inductor generated vector code for."""
    graph = exported.graph_module.print_readable(print_output=False, include_stride=True, include_device=True)
    lifted = {
        name: hashlib.sha256(value.detach().contiguous().cpu().numpy().tobytes()).hexdigest()
        if isinstance(value, torch.Tensor)
        else repr(value)
        for name, value in sorted(exported.constants.items())
    }
    record = {
        "graph": graph,
        "signature": str(exported.graph_signature),
        "ranges": sorted(str(item) for item in exported.range_constraints.items()),
        "lifted_constants": lifted,
        "configs": {name: repr(value) for name, value in sorted(configs.items())},
        # the model library links the kernel library's C shims, declared by quant_ops' op schemas
        "kernels": None if kernels is None else library_fingerprint(QuantIsa(kernels.isa)),
        "op_schemas": hashlib.sha256(Path(quant_ops.__file__).read_bytes()).hexdigest(),
        "cpu_flags": sorted(cpu_features()),
        "torch": torch.__version__,
    }
    return ArtifactKey.of("step", record)
