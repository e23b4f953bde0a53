"""bench/quality.py on the tiny engines: an engine against itself scores exactly perfect, and the
fp16-KV engine agrees on every token with a KL above zero (its logits really moved)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "bench" / "quality.py"


def test_quality_of_itself_and_of_fp16_kv(
    tiny_llama_engine: Path, tiny_llama_kv16_engine: Path, tmp_path: Path
) -> None:
    output = tmp_path / "quality.json"
    command = [
        sys.executable,
        str(SCRIPT),
        "--reference",
        str(tiny_llama_engine),
        "--candidate",
        str(tiny_llama_engine),
        "--candidate",
        str(tiny_llama_kv16_engine),
        "--num-prompts",
        "5",
        "--max-new-tokens",
        "12",
        "--output",
        str(output),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "top-1 agree" in result.stdout and "KV float16" in result.stdout
    record = json.loads(output.read_text())
    reference, (itself, kv16) = record["reference"], record["candidates"]
    assert reference["prompts"] == 5 and reference["positions"] == sum(reference["continuation_tokens"]) > 5
    assert all(1 <= n <= 12 for n in reference["continuation_tokens"])
    for row in (itself, kv16):
        assert row["positions"] == reference["positions"] and len(row["first_divergence"]) == 5
    # the same compiled engine, the same steps: bit-identical logits
    assert (itself["top1_agreement"], itself["mean_kl"], itself["max_kl"]) == (1.0, 0.0, 0.0)
    assert itself["greedy_identical_fraction"] == 1.0 and itself["first_divergence"] == [None] * 5
    assert kv16["kv_dtype"] == "float16" and kv16["top1_agreement"] == 1.0
    assert 0 < kv16["mean_kl"] <= kv16["max_kl"] < 1e-6
