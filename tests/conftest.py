"""Shared fixtures: tiny seeded checkpoints and engines built by the real builder into tmp dirs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import TINY_LIMITS, write_gguf, write_hf_checkpoint  # noqa: E402

from ifb.builder.build import BuildOptions, build_engine  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    return write_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.gguf", tiny_llama_dir)


def _build(tmp_path_factory: pytest.TempPathFactory, source: Path, name: str, dtype: str) -> Path:
    output = tmp_path_factory.mktemp("engines") / name
    build_engine(source, output, BuildOptions(dtype=dtype, **TINY_LIMITS))
    return output


@pytest.fixture(scope="session")
def tiny_llama_engine(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    return _build(tmp_path_factory, tiny_llama_dir, "tiny-llama-fp32", "fp32")


@pytest.fixture(scope="session")
def tiny_qwen2_engine(tmp_path_factory: pytest.TempPathFactory, tiny_qwen2_dir: Path) -> Path:
    return _build(tmp_path_factory, tiny_qwen2_dir, "tiny-qwen2-fp32", "fp32")


@pytest.fixture(scope="session")
def tiny_gguf_engine(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Path:
    return _build(tmp_path_factory, tiny_gguf, "tiny-gguf-fp32", "fp32")
