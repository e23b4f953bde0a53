"""GPU fixtures: tiny TensorRT engines, built once per session. Every test here is marked `gpu`
and skipped cleanly where there is no CUDA device or no tensorrt module."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import TINY_LIMITS

from ifb.builder.build import Backend, BuildOptions, build_engine
from ifb.runtime.step.gpu import tensorrt_unavailable_reason

UNAVAILABLE = tensorrt_unavailable_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
            if UNAVAILABLE is not None:
                item.add_marker(pytest.mark.skip(reason=f"no CUDA/TensorRT here: {UNAVAILABLE}"))


def _build_trt(tmp_path_factory: pytest.TempPathFactory, source: Path, dtype: str) -> Path:
    output = tmp_path_factory.mktemp("trt-engines") / f"tiny-llama-{dtype}"
    build_engine(source, output, BuildOptions(dtype=dtype, backend=Backend.TENSORRT, **TINY_LIMITS))
    return output


@pytest.fixture(scope="session")
def tiny_llama_trt_fp32(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    return _build_trt(tmp_path_factory, tiny_llama_dir, "fp32")


@pytest.fixture(scope="session")
def tiny_llama_trt_bf16(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    return _build_trt(tmp_path_factory, tiny_llama_dir, "bf16")
