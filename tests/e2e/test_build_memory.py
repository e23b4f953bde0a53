"""`ifb build` of a block-quantized GGUF stays within the file's size plus a fixed overhead.

A generated Q4_K_M-like model of ~150 MB is built by the CLI in its own process; each build
phase's peak resident memory (the kernel's VmHWM, engine.json's build.stage_peak_rss_mb) must be
at most the file size + 1.5 GiB, and the engine folder at most 1.15x the file (weights stored
once, in their blocks). Through transformers' dequantizing loader this build needed about 20x the
file (a 669 MB file was killed at 24 GB). The engine bakes in a 2 GB KV pool, more than the
bound: a build that made the pool resident (the export's sample pools, calibration's KV) fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import Q4_K_M_LIKE, write_gguf, write_hf_checkpoint

OVERHEAD_BYTES = int(1.5 * 2**30)
SHAPE = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    tie_word_embeddings=True,
)
TYPES = {**Q4_K_M_LIKE, "ffn_down": "Q6_K"}  # rows of 4096: down stays a K-quant


@pytest.fixture(scope="module")
def medium_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_hf_checkpoint(tmp_path_factory.mktemp("medium-hf"), "llama", seed=5, **SHAPE)
    path = write_gguf(tmp_path_factory.mktemp("medium") / "medium-q4_k_m.gguf", folder, tensor_types=TYPES, seed=5)
    for file in folder.glob("*.safetensors"):
        file.unlink()  # only the GGUF is the build's input
    return path


def test_build_peak_memory_is_the_file_plus_a_bounded_overhead(medium_gguf: Path, tmp_path: Path) -> None:
    output = tmp_path / "engine"
    command = [sys.executable, "-m", "ifb.cli.main", "build", str(medium_gguf), "-o", str(output)]
    command += ["--max-batch-size", "4", "--max-num-tokens", "64", "--max-seq-len", "256", "--kv-memory", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((output / "engine.json").read_text())
    peaks = {phase: mb * 2**20 for phase, mb in record["build"]["stage_peak_rss_mb"].items()}
    file_bytes = medium_gguf.stat().st_size
    assert file_bytes > 100e6  # the model is big enough for a 20x loader to show
    assert set(peaks) >= {"read", "pack", "compile", "write", "calibrate"}
    assert record["kv_pool"]["bytes"] > OVERHEAD_BYTES  # the pool alone would break the bound
    assert max(peaks.values()) <= file_bytes + OVERHEAD_BYTES, (peaks, file_bytes)
    folder_bytes = sum(p.stat().st_size for p in output.rglob("*") if p.is_file())
    assert folder_bytes <= 1.15 * file_bytes, (folder_bytes, file_bytes)
