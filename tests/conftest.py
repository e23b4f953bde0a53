"""Shared fixtures: tiny seeded checkpoints and engines built by the real builder into tmp dirs."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Step cost models reused between builds (runtime/step_budget/cost_model_cache.py) are this session's own:
# never read from a developer's cache, never left in it.
os.environ["IFB_CACHE_DIR"] = _SESSION_CACHE = tempfile.mkdtemp(prefix="ifb-test-cache-")
atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)
sys.path.insert(0, str(Path(__file__).parent))

from isa_report import MARKER, IsaReport  # noqa: E402
from kernel_builds import KernelBuilds  # noqa: E402
from tiny_models import TINY_LIMITS, write_gguf, write_hf_checkpoint  # noqa: E402

from ifb.builder.build import BuildOptions, build_engine  # noqa: E402
from ifb.plugins.quant_build import QuantLibrary  # noqa: E402

_ISA_REPORT = IsaReport()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}(isa): the test compiles and runs this kernel ISA path")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _ISA_REPORT.record(item, report)
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Which kernel ISA paths ran and which were skipped (and why): the AVX2 and AVX-512 builds
    are compared only on a CPU that runs both."""
    for line in _ISA_REPORT.lines():
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def kernel_builds(tmp_path_factory: pytest.TempPathFactory) -> KernelBuilds:
    return KernelBuilds(tmp_path_factory.mktemp("kernel-builds"))


@pytest.fixture(scope="session")
def quant_library(kernel_builds: KernelBuilds) -> QuantLibrary:
    """This CPU's kernel library, built once for the run and loaded into the test process."""
    return kernel_builds.own()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    return write_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.gguf", tiny_llama_dir)


@pytest.fixture(scope="session")
def tiny_q4_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    """The tiny Llama as llama.cpp would quantize it: Q4_1 linear layers, a Q8_0 embedding."""
    path = tmp_path_factory.mktemp("tiny-q4-gguf") / "tiny-llama-q4_1.gguf"
    return write_gguf(path, tiny_llama_dir, linear_type="Q4_1", embed_type="Q8_0")


def _build(
    tmp_path_factory: pytest.TempPathFactory, source: Path, name: str, dtype: str, kv_dtype: str = "auto"
) -> Path:
    output = tmp_path_factory.mktemp("engines") / name
    # compute fp32: these engines are compared with transformers (`--compute auto` is int8 for blocks)
    build_engine(source, output, BuildOptions(dtype=dtype, kv_dtype=kv_dtype, compute="fp32", **TINY_LIMITS))
    return output


@pytest.fixture(scope="session")
def tiny_llama_engine(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    return _build(tmp_path_factory, tiny_llama_dir, "tiny-llama-fp32", "fp32")


@pytest.fixture(scope="session")
def tiny_llama_kv16_engine(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    """The fp32 tiny Llama with `--kv-dtype fp16`: an fp16 KV pool under an fp32 step."""
    return _build(tmp_path_factory, tiny_llama_dir, "tiny-llama-fp32-kvfp16", "fp32", kv_dtype="fp16")


@pytest.fixture(scope="session")
def tiny_qwen2_engine(tmp_path_factory: pytest.TempPathFactory, tiny_qwen2_dir: Path) -> Path:
    return _build(tmp_path_factory, tiny_qwen2_dir, "tiny-qwen2-fp32", "fp32")


@pytest.fixture(scope="session")
def tiny_gguf_engine(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Path:
    return _build(tmp_path_factory, tiny_gguf, "tiny-gguf-fp32", "fp32")


@pytest.fixture(scope="session")
def tiny_q4_gguf_engine(tmp_path_factory: pytest.TempPathFactory, tiny_q4_gguf: Path) -> Path:
    """`--weights auto` on a Q4_1/Q8_0 GGUF: every linear keeps its Q4_1 blocks."""
    return _build(tmp_path_factory, tiny_q4_gguf, "tiny-gguf-q4_1", "auto")


@pytest.fixture(scope="session")
def tiny_q4_gguf_kv16_engine(tmp_path_factory: pytest.TempPathFactory, tiny_q4_gguf: Path) -> Path:
    """The Q4_1 GGUF engine with `--kv-dtype fp16` (the block kernels' batch invariance, fp16 KV)."""
    return _build(tmp_path_factory, tiny_q4_gguf, "tiny-gguf-q4_1-kvfp16", "auto", kv_dtype="fp16")


@pytest.fixture(scope="session")
def tiny_q4_gguf_int8_engine(tmp_path_factory: pytest.TempPathFactory, tiny_q4_gguf: Path) -> Path:
    """The Q4_1/Q8_0 GGUF engine with `--compute int8` (int8 activations, integer dots)."""
    output = tmp_path_factory.mktemp("engines") / "tiny-gguf-q4_1-int8"
    build_engine(tiny_q4_gguf, output, BuildOptions(dtype="auto", compute="int8", **TINY_LIMITS))
    return output


@pytest.fixture(scope="session")
def tiny_qwen2_q8_engine(tmp_path_factory: pytest.TempPathFactory, tiny_qwen2_dir: Path) -> Path:
    """HF Qwen2 (tied embeddings, qkv bias) quantized at build time with `--weights q8_0`."""
    output = tmp_path_factory.mktemp("engines") / "tiny-qwen2-q8_0"
    build_engine(tiny_qwen2_dir, output, BuildOptions(dtype="auto", weights="q8_0", compute="fp32", **TINY_LIMITS))
    return output


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    """The CLI configures the root logger; later tests get it back as it was (modules that run
    the CLI in-process use it for every test)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
