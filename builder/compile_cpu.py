"""The CPU backend: export the step network with bounded dynamic shapes, compile it ahead of time.

AOTInductor with freezing turns the network into a shared library whose weights are constants
prepacked for this CPU's matrix units (oneDNN/AMX for bf16); `ifb run` loads the package
without recompiling.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import torch

from ifb.builder.step_export import dynamic_shapes, sample_args
from ifb.plugins import quant_ops
from ifb.plugins.quant_build import build_quant_library
from ifb.runtime.engine_format import EngineLimits, KernelLibraryInfo
from ifb.runtime.step.kernels import ensure_quant_library
from ifb.runtime.step.network import StepNetwork

logger = logging.getLogger(__name__)

# Freezing folds the weights in as constants and prepacks them (MKL for fp32, oneDNN for bf16).
# max_autotune with Inductor's C++ GEMM templates was measured too: on the full SmolLM2 step it
# picked kernels no faster than the packed MKL ones (decode b1/b8/b32: 23/47/147 ms vs
# 26/44/133 ms) and added a minute of compile, so it stays off.
INDUCTOR_CONFIGS: dict[str, object] = {"freezing": True}
KERNELS_DIR = "kernels"


def build_engine_kernels(folder: Path) -> KernelLibraryInfo:
    """Compile the block-quantized matmul library into `folder`/kernels and load it here (it must be
    loaded before export, and the compiled model library links its C shim)."""
    with tempfile.TemporaryDirectory(prefix="ifb-quant-") as scratch:
        library = build_quant_library(Path(scratch))  # object files stay out of the engine folder
        (folder / KERNELS_DIR).mkdir()
        target = folder / KERNELS_DIR / library.path.name
        shutil.copyfile(library.path, target)
    ensure_quant_library(target, library.isa.value, library.required_features)
    logger.info("built %s (%s)", target.name, library.isa.value)
    return KernelLibraryInfo(f"{KERNELS_DIR}/{target.name}", library.isa.value, library.required_features)


def compile_cpu_engine(
    network: StepNetwork,
    limits: EngineLimits,
    kv_cache: torch.Tensor,
    package_path: Path,
    constants_in_package: bool = True,
) -> Path:
    """Export and AOT-compile `network` into a .pt2 package at `package_path` (any packed weight's
    op must be loaded already: see `build_engine_kernels`). Without `constants_in_package` the
    library holds no weights: the runtime binds them by name (AotiStep), and compiling does not
    serialize a second copy of them (for a 1B model that copy alone is the size of the file)."""
    network.eval()
    sample = sample_args(limits, kv_cache)
    with torch.no_grad():
        exported = torch.export.export(network, sample, dynamic_shapes=dynamic_shapes(limits, 2 * kv_cache.shape[0]))
        logger.info("exported step graph with %d nodes", len(exported.graph.nodes))
        path = torch._inductor.aoti_compile_and_package(
            exported,
            package_path=str(package_path),
            inductor_configs={
                **INDUCTOR_CONFIGS,
                **(quant_ops.aoti_configs() if network.weight_formats else {}),
                "aot_inductor.package_constants_in_so": constants_in_package,
                # Freezing makes new constants (prepacked dense weights, `_frozen_param*`) that no
                # weights file holds; weights bound at load must stay the network's own tensors.
                "freezing": constants_in_package,
            },
        )
    return Path(path)
