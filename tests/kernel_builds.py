"""The kernel library built once per ISA for the whole test run.

Each build compiles every kernel source (about 30 s on 2 cores); a dozen test modules that each
compiled their own copy, and five other-ISA comparisons that each compiled AVX2 and AVX-512 again,
spent about 9 of the run's 42 minutes doing it. A build is a function of the sources, the ISA and
the compiler, all fixed for one run, so one per ISA serves every test.
"""

from __future__ import annotations

from pathlib import Path

from ifb.plugins.quant_build import (
    QuantIsa,
    QuantLibrary,
    best_isa,
    build_quant_library,
    cpu_features,
    load_quant_library,
)


class KernelBuilds:
    """Kernel library builds under `root`, one per ISA, made when first asked for."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._built: dict[QuantIsa, QuantLibrary] = {}

    def build(self, isa: QuantIsa) -> QuantLibrary:
        """`isa`'s build (not loaded: another ISA's runs in a process of its own)."""
        if isa not in self._built:
            self._built[isa] = build_quant_library(self._root / isa.value, isa)
        return self._built[isa]

    def own(self) -> QuantLibrary:
        """The build `ifb build` would pick on this CPU, loaded into this process."""
        library = self.build(best_isa(cpu_features()))
        load_quant_library(library.path, library.required_features)
        return library
