"""Dependencies point down: cli / the ifb facade -> builder -> runtime -> plugins, never back up."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, lazily inside functions included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def offenders(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        bad = sorted(m for m in imported_modules(path) if m.startswith(forbidden))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_the_runtime_never_imports_the_builder_or_the_cli() -> None:
    assert offenders("runtime", ("ifb.builder", "ifb.cli", "ifb.find_or_build", "ifb.llm")) == {}


def test_the_builder_never_imports_the_cli_or_the_facade() -> None:
    assert offenders("builder", ("ifb.cli", "ifb.find_or_build", "ifb.llm")) == {}


def test_plugins_import_neither_runtime_nor_builder() -> None:
    assert offenders("plugins", ("ifb.runtime", "ifb.builder", "ifb.cli")) == {}


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    """The parser must catch an import hidden inside a function, or the tests above prove nothing."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from ifb.builder.build import build_engine\n")
    assert imported_modules(sample) == {"ifb.builder.build"}


def test_the_scheduling_side_imports_no_torch() -> None:
    """Request, scheduler, policies and KV manager are plain Python: they load without torch."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import ifb.runtime.request, ifb.runtime.scheduler, ifb.runtime.policies, ifb.runtime.kv_cache_manager\n"
        "import ifb.runtime.windowed_kv_cache_manager, ifb.runtime.admission\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'xgrammar', 'numpy')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


# The request's vocabulary (parameters, outputs, errors, how a reply splits into reasoning and
# content) and the EngineClient protocol: all the server may know of the engine, so the
# in-process LLM and the Ray replica set serve alike.
SERVER_MAY_IMPORT = (
    "ifb.runtime.engine_client",
    "ifb.runtime.engine_snapshot",
    "ifb.runtime.errors",
    "ifb.runtime.guided",
    "ifb.runtime.outputs",
    "ifb.runtime.reasoning",
    "ifb.runtime.request",
    "ifb.runtime.sampling_params",
    "ifb.runtime.server",
    "ifb.runtime.unicode_text",
)


def test_the_server_uses_the_engine_only_through_engine_client() -> None:
    found = {}
    for path in sorted((ROOT / "runtime" / "server").rglob("*.py")):
        engine_modules = {m for m in imported_modules(path) if m.startswith("ifb.")}
        bad = sorted(m for m in engine_modules if not m.startswith(SERVER_MAY_IMPORT))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    assert found == {}


def test_both_engine_clients_implement_every_member_of_the_protocol() -> None:
    from ifb.ray_serve.proxy import ReplicaSetLLM
    from ifb.runtime.engine_client import EngineClient
    from ifb.runtime.llm import LLM

    members = {name for name in vars(EngineClient) if not name.startswith("_")}
    assert {"open_streams", "abort", "health_report", "metrics_text", "capacity", "model_info"} <= members
    for client in (LLM, ReplicaSetLLM):
        assert sorted(m for m in members if not hasattr(client, m)) == [], client.__name__
