"""Compiles the block-quantized matmul library for this machine's CPU and loads it at run time.

Compiling happens only here, at engine build time (`ifb build`); the runtime calls
`load_quant_library` with the record stored in engine.json, which refuses a CPU lacking the
features the library was compiled for instead of dying on an illegal instruction.

The kernel TU includes no torch header and gets the ISA flags (about 2 s); the thin binding TU
gets the torch headers and no ISA flag (about 7 s); both compile in parallel. Neither uses
-march=native (the record names exactly what the .so needs) and both use -ffp-contract=off.

Load order for AOTInductor: the compiled model library references the shim
`aoti_torch_cpu_quant_matmul` as an undefined symbol, so the quant library must be loaded with
RTLD_GLOBAL before the model library is dlopen'ed (`load_quant_library` does so).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
from torch.utils import cpp_extension

_CSRC = Path(__file__).parent / "csrc"
# Torch-free kernel translation units, compiled with the ISA flags.
KERNEL_SOURCES = ("quant_matmul", "quant_matmul_int8", "paged_decode_attention", "paged_prefill_attention")
# Torch-side translation units (torch headers, no ISA flag): the ops' registrations and C shims.
BINDING_SOURCES = ("quant_binding", "grouped_experts")
_REBUILD_HINT = "rebuild the engine on this machine with `ifb build`"


class QuantIsa(str, Enum):
    """The instruction-set path compiled into the library."""

    AVX512_VNNI = "avx512_vnni"  # AVX-512 plus vpdpbusd for the int8 compute mode
    AVX512 = "avx512"
    AVX2 = "avx2"


# /proc/cpuinfo flag names each path needs, and the g++ flags that enable exactly those.
_ISA_FEATURES = {
    QuantIsa.AVX512_VNNI: ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    QuantIsa.AVX512: ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"),
    QuantIsa.AVX2: ("avx2", "fma", "f16c"),
}
_GCC_FLAG = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl", "avx512_vnni": "-mavx512vnni"}


class QuantLibraryError(RuntimeError):
    """The quant library cannot be built or loaded on this machine."""


@dataclass(frozen=True, slots=True)
class QuantLibrary:
    """A compiled quant library, as recorded in engine.json."""

    path: Path
    isa: QuantIsa
    required_features: tuple[str, ...]
    sha256: str

    def to_json(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "isa": self.isa.value,
            "required_features": list(self.required_features),
            "sha256": self.sha256,
        }


def cpu_features() -> frozenset[str]:
    """The flags of the first processor in /proc/cpuinfo."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def isa_features(isa: QuantIsa) -> tuple[str, ...]:
    """The /proc/cpuinfo flags a library compiled for `isa` needs."""
    return _ISA_FEATURES[isa]


def best_isa(features: frozenset[str]) -> QuantIsa:
    """The fastest path this CPU runs; refuses CPUs without the AVX2+FMA+F16C baseline."""
    for isa in (QuantIsa.AVX512_VNNI, QuantIsa.AVX512, QuantIsa.AVX2):
        if set(_ISA_FEATURES[isa]) <= features:
            return isa
    missing = sorted(set(_ISA_FEATURES[QuantIsa.AVX2]) - features)
    raise QuantLibraryError(f"block-quantized weights need a CPU with {', '.join(missing)}")


def _isa_flags(isa: QuantIsa) -> list[str]:
    return [_GCC_FLAG.get(feature, f"-m{feature}") for feature in _ISA_FEATURES[isa]]


def _compile_commands(isa: QuantIsa, out: Path) -> tuple[list[list[str]], list[str]]:
    common = ["g++", "-O3", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off", "-c"]
    kernels = [
        [*common, "-std=c++17", *_isa_flags(isa), str(_CSRC / f"{name}.cpp"), "-o", str(out / f"{name}.o")]
        for name in KERNEL_SOURCES
    ]
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    # -fopenmp: at::parallel_for is an inline `#pragma omp parallel` in ATen's headers; without
    # the flag it silently runs on one thread. Links libgomp.so.1, the SONAME torch already loaded.
    bindings = [
        [*common, "-std=c++20", "-fopenmp", abi, *includes, str(_CSRC / f"{name}.cpp"), "-o", str(out / f"{name}.o")]
        for name in BINDING_SOURCES
    ]
    library_dir = cpp_extension.library_paths()[0]
    objects = [str(out / f"{name}.o") for name in (*KERNEL_SOURCES, *BINDING_SOURCES)]
    link = ["g++", "-shared", "-fopenmp", "-Wl,-Bsymbolic", *objects]
    link += [f"-L{library_dir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{library_dir}", "-o"]
    return [*bindings, *kernels], link  # the bindings (torch's headers) take longest: first


# Compilers at once: the four used to run together, 1.16 GB of the 1B build tree's 2.0 GiB peak
# (the torch-header binding alone ~0.6 GB); two keep both cores of a small machine busy.
MAX_PARALLEL_COMPILES = 2


def _run_one(command: list[str]) -> None:
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if done.returncode != 0:
        raise QuantLibraryError(f"{' '.join(command[:8])} ... failed:\n{done.stdout}")


def _run(commands: list[list[str]]) -> None:
    """Runs `commands` at most MAX_PARALLEL_COMPILES at a time, in order (the slowest first)."""
    with ThreadPoolExecutor(max_workers=MAX_PARALLEL_COMPILES) as pool:
        for future in [pool.submit(_run_one, command) for command in commands]:
            future.result()


def library_name(isa: QuantIsa) -> str:
    return f"libifb_quant_{isa.value}.so"


def _compiler_version() -> str:
    done = subprocess.run(
        ["g++", "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
    )
    return done.stdout.splitlines()[0] if done.stdout else f"g++ exited {done.returncode}"


def library_fingerprint(isa: QuantIsa) -> dict[str, object]:
    """What the library's bytes depend on: every source and header, the commands (paths made
    neutral), the compiler and torch (the binding's headers): a compile cache's key record."""
    sources = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(_CSRC.iterdir())}
    compiles, link = _compile_commands(isa, Path("/OUT"))
    commands = [" ".join(command).replace(str(_CSRC), "CSRC") for command in [*compiles, link]]
    return {
        "isa": isa.value,
        "sources": sources,
        "commands": commands,
        "compiler": _compiler_version(),
        "torch": torch.__version__,
    }


def build_quant_library(out_dir: Path, isa: QuantIsa | None = None) -> QuantLibrary:
    """Compiles libifb_quant_<isa>.so into `out_dir` for `isa` (default: the best this CPU runs)."""
    chosen = isa if isa is not None else best_isa(cpu_features())
    out_dir.mkdir(parents=True, exist_ok=True)
    objects = out_dir / f"obj-{chosen.value}"
    objects.mkdir(exist_ok=True)
    path = out_dir / library_name(chosen)
    compiles, link = _compile_commands(chosen, objects)
    _run(compiles)
    _run([[*link, str(path)]])
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return QuantLibrary(path, chosen, _ISA_FEATURES[chosen], digest)


def load_quant_library(path: Path, required_features: tuple[str, ...] | list[str]) -> str:
    """Loads a built library (RTLD_GLOBAL, then into torch.ops); returns its ISA name.

    Raises QuantLibraryError with one line naming the missing CPU features, if any.
    """
    missing = sorted(set(required_features) - cpu_features())
    if missing:
        raise QuantLibraryError(
            f"{path.name} needs CPU features this machine lacks: {', '.join(missing)}; {_REBUILD_HINT}"
        )
    import ifb.plugins.grouped_experts  # noqa: F401  (and the MoE op's)
    import ifb.plugins.quant_ops  # noqa: F401  (defines the op schemas the library implements)

    # RTLD_GLOBAL: AOTInductor model libraries resolve aoti_torch_cpu_quant_matmul from it.
    handle = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    torch.ops.load_library(str(path))
    handle.ifb_quant_isa_name.restype = ctypes.c_char_p
    return str(handle.ifb_quant_isa_name().decode())


def _loaded(path: Path) -> ctypes.CDLL:
    """The handle of the library at `path`, which load_quant_library must have loaded already."""
    try:
        return ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except OSError as error:
        raise QuantLibraryError(f"{path.name} is not loaded in this process (load_quant_library first)") from error


def one_row_tiles(path: Path) -> int:
    """How many column tiles the loaded library at `path` streams at once in a one-row int8 pass
    over a nibble format or Q8_0: a speed choice by CPU (quant_matmul_int8.cpp), never a change of bits."""
    return int(_loaded(path).ifb_quant_one_row_tiles())


def wide_one_row_tiles(path: Path) -> int:
    """The loaded library's other one-row tile count, beside 1: 4 on AVX-512, 2 on AVX2."""
    return int(_loaded(path).ifb_quant_wide_one_row_tiles())


def set_one_row_tiles(path: Path, tiles: int | None) -> None:
    """Sets that count for the loaded library at `path`: 1, or its wide count (4 on AVX-512, 2 on
    AVX2); None gives the choice back to the CPU's default. For A/B runs and tests."""
    if not _loaded(path).ifb_quant_set_one_row_tiles(0 if tiles is None else tiles):
        wide = wide_one_row_tiles(path)
        raise ValueError(f"one-row tiles must be 1 or {wide} for {path.name} (None: the CPU's choice), got {tiles}")
