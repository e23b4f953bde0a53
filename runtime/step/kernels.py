"""Loads an engine's weight-kernel library (plugins/quant_build.py) before its step is created.

The compiled step's model library resolves `aoti_torch_cpu_quant_matmul` from the quant library,
so this must run before AotiStep dlopens it; the eager network needs the op registered too.
`ifb run` never compiles: the library is the one `ifb build` wrote into the engine folder.
"""

from __future__ import annotations

import re
from pathlib import Path

from ifb.plugins.quant_build import QuantLibraryError, cpu_features, load_quant_library
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.errors import EngineFormatError

# ISA name -> the library loaded for it. One per process: a second dlopen of another copy of
# the same ISA would only re-register the same kernels (torch warns "Overriding ...").
_LOADED: dict[str, Path] = {}


def ensure_quant_library(path: Path, isa: str, required_features: tuple[str, ...]) -> None:
    """Load the library at `path` unless one for `isa` is loaded already (QuantLibraryError if not loadable)."""
    if isa in _LOADED:
        return
    load_quant_library(path, required_features)
    _LOADED[isa] = path


def load_engine_kernels(config: EngineConfig) -> None:
    """Load `config`'s kernel library, if it has one; refuses a CPU lacking a feature in one line."""
    if config.kernels is None or config.kernels_path is None:
        return
    missing = sorted(set(config.kernels.cpu_features) - cpu_features())
    if missing:
        raise EngineFormatError(
            f"engine {config.folder} was built for CPU features this machine lacks ({', '.join(missing)}); "
            f"rebuild it here: {config.rebuild_command()}"
        )
    try:
        ensure_quant_library(config.kernels_path, config.kernels.isa, config.kernels.cpu_features)
    except (QuantLibraryError, OSError) as error:
        raise EngineFormatError(f"engine {config.folder}: cannot load {config.kernels.path}: {error}") from error


def step_load_error(config: EngineConfig, error: OSError) -> Exception:
    """What a compiled step's failed dlopen means, in one line, where the cause is ours.

    One kernel library per ISA serves the process (the first engine's), and a compiled step
    resolves its shims from it. A step built by a newer ifb can call a shim an older library
    lacks (every block engine since the one attention op calls `aoti_torch_cpu_paged_attention`),
    so a router serving an older engine first would fail the newer one with dlopen's bare
    "undefined symbol". Not guessed around: another library's kernels may read other layouts."""
    missing = re.search(r"undefined symbol: (\w+)", str(error))
    if config.kernels is None or missing is None:
        return error
    loaded = _LOADED.get(config.kernels.isa)
    if loaded is None or loaded == config.kernels_path:
        return error
    return EngineFormatError(
        f"engine {config.folder}: its compiled step calls {missing.group(1)}, which the {config.kernels.isa} "
        f"kernel library this process loaded first ({loaded}, of an engine built by another ifb version) "
        "lacks; serve the two engines in separate processes, or rebuild the older one with this ifb"
    )
