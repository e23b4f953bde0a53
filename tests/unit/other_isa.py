"""Another ISA's build of the kernel library, run in a process of its own: how the kernel tests
show that the AVX2, AVX-512 and VNNI builds give this build's exact bits.

A process loads one kernel library (the ops register under one name), so each comparison builds
the other path, runs the cases there and compares what comes back with this process's results.
The skip reasons are the ones tests/isa_report.py counts in the run's ISA summary.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_builds import KernelBuilds

from ifb.plugins.quant_build import QuantIsa, QuantLibrary, cpu_features

# What every side script may use; it reads `cases` and must leave its results in `out`.
_PRELUDE = """
import sys, torch
from pathlib import Path
from ifb.plugins import quant_ops
from ifb.plugins.quant_build import load_quant_library
from ifb.plugins.quant_formats import WeightCompute, WeightFormat
assert load_quant_library(Path(sys.argv[1]), []) == sys.argv[4]
cases = torch.load(sys.argv[2])
"""


def other_isa_build(builds: KernelBuilds, isa: QuantIsa) -> QuantLibrary:
    """`isa`'s build of the kernel library, or the test skipped naming why it cannot be compared."""
    if isa == builds.own().isa:
        pytest.skip(f"{isa.value} is this machine's own build")
    other = builds.build(isa)
    if not set(other.required_features) <= cpu_features():
        pytest.skip(f"this CPU cannot run the {isa.value} path")
    return other


def run_in_build(library: QuantLibrary, body: str, cases: object, scratch: Path) -> object:
    """`body` (Python that reads `cases` and sets `out`) run in a process that loaded `library`
    and nothing else; returns its `out`."""
    torch.save(cases, scratch / "cases.pt")
    script = _PRELUDE + body + "\ntorch.save(out, sys.argv[3])\n"
    command = [sys.executable, "-c", script, str(library.path), str(scratch / "cases.pt"), str(scratch / "out.pt")]
    result = subprocess.run([*command, library.isa.value], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return torch.load(scratch / "out.pt")
