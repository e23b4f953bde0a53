"""Prints the pip arguments that install pyproject's torch pin as a CPU build on this machine.

    $(PY) -m pip install $$($(PY) scripts/torch_source.py --index URL)

A plain `pip install torch==X` on Linux takes PyPI's CUDA build (several GB with its nvidia-*
wheels) unless pip's own sources (find-links, a local index) hold a CPU build, as they do on
machines that keep `torch-X+cpu` on disk. So: when pip can already pick a `+cpu` torch without
touching any index, install plainly; otherwise add PyTorch's CPU index, whose `X+cpu` outranks
PyPI's `X`. On macOS and Windows PyPI's wheels are CPU builds: plain install.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def torch_requirement(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """pyproject's torch requirement, e.g. `torch==2.13.0` (the one place the pin lives)."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pins = [d.split(";")[0].strip() for d in dependencies if d.startswith("torch") and d[5:6] in "=<>!~ "]
    if len(pins) != 1:
        raise SystemExit(f"expected one torch requirement in {pyproject}, found {pins}")
    return pins[0].replace(" ", "")


def local_torch_version(requirement: str) -> str | None:
    """The torch version pip would take for `requirement` from find-links alone (no index), or None."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        probe = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps"]
        probe += ["--no-index", "--quiet", "--report", str(report), requirement]
        if subprocess.run(probe, capture_output=True, text=True).returncode != 0 or not report.exists():
            return None
        install = json.loads(report.read_text()).get("install", [])
    return install[0]["metadata"]["version"] if install else None


def is_cpu_build(version: str | None, platform: str) -> bool:
    """True when installing `version` gets a torch without CUDA libraries."""
    if platform != "linux":
        return True  # PyPI's macOS and Windows wheels carry no CUDA
    return version is not None and version.partition("+")[2].startswith("cpu")


def torch_install_args(requirement: str, local_version: str | None, platform: str, index: str) -> list[str]:
    """What to hand to `pip install`: the requirement, plus the CPU index when pip alone would miss it."""
    if is_cpu_build(local_version, platform):
        return [requirement]
    return [requirement, "--extra-index-url", index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", default=CPU_INDEX, help="PyTorch's CPU wheel index (Makefile: TORCH_INDEX)")
    index = parser.parse_args().index or CPU_INDEX
    requirement = torch_requirement()
    local = local_torch_version(requirement) if sys.platform == "linux" else None
    args = torch_install_args(requirement, local, sys.platform, index)
    if len(args) > 1:
        source = f"the CPU build from {index} (no local CPU wheel for pip)"
    else:
        source = f"{local} from this machine's wheels" if local else "PyPI (CPU builds on this platform)"
    print(f"torch: {requirement} -> {source}", file=sys.stderr)
    print(" ".join(args))


if __name__ == "__main__":
    main()
