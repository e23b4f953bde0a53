"""The prefix cache's disk tier on the tiny Llama engine: a prompt's prefix survives a restart
(written at shutdown) and an eviction (spilled), and comes back with the cold run's greedy
tokens; a flipped byte is refused and counted; an engine with another build id never hits.

Without the tier (make_block_tier returning NO_TIER) every test here fails: nothing is restored,
so the disk hit counters stay 0 where 96 tokens are expected."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from step_cases import prompts
from tiny_models import TINY_LIMITS

from ifb import LLM
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.engine_format.artifacts import RECORD_SHA256, record_sha256
from ifb.runtime.prefix_disk_tier import SUFFIX, block_file_name
from ifb.runtime.prefix_hash import prefix_block_keys
from ifb.runtime.sampling_params import SamplingParams

BLOCK = TINY_LIMITS["block_size"]  # 16
PROMPT_LEN = 100  # 6 full blocks a later request can hit (one token is always computed)
HIT_TOKENS = 6 * BLOCK
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt(tiny_llama_engine: Path) -> list[int]:
    vocab = EngineConfig.load(tiny_llama_engine, verify=False).spec.vocab_size
    return prompts(vocab, [PROMPT_LEN], seed=21)[0]


def serve_once(engine: Path, directory: Path, prompt: list[int], **settings: object) -> tuple[list[int], LLM]:
    """One server's life: the prompt's greedy tokens, then a clean stop (which flushes RAM's cache)."""
    llm = LLM(engine, prefix_cache_dir=str(directory), **settings)
    try:
        tokens = list(llm.generate(prompt, GREEDY)[0].token_ids)
    finally:
        llm.close()
    return tokens, llm


def metric(llm: LLM, name: str) -> float:
    for line in llm.metrics_text().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def block_files(directory: Path) -> set[str]:
    return {path.name for path in directory.glob("*" + SUFFIX)}


def test_a_restart_restores_the_prefix_from_disk(tiny_llama_engine: Path, prompt: list[int], tmp_path: Path) -> None:
    """Server 1 computes the prompt and stops; server 2 on the same directory hits its 6 full
    blocks from disk (read, verified, copied into its pool) and generates the same tokens."""
    cold, first = serve_once(tiny_llama_engine, tmp_path, prompt)
    written = first.stats().kv.disk
    assert written.hit_tokens == 0 and written.bytes_written > 0
    assert len(block_files(tmp_path)) == 6  # the prompt's full blocks; the 7th was never full
    warm, second = serve_once(tiny_llama_engine, tmp_path, prompt)
    kv = second.stats().kv
    assert warm == cold
    assert (kv.prefix_cache_hit_tokens, kv.disk.hit_tokens, kv.disk.miss_tokens) == (HIT_TOKENS, HIT_TOKENS, 0)
    assert kv.disk.bytes_read == written.bytes_written and kv.disk.rejected_files == 0
    assert metric(second, "ifb:prefix_cache_disk_hits_total") == HIT_TOKENS
    assert metric(second, "ifb:prefix_cache_disk_read_bytes_total") == written.bytes_written
    assert metric(first, "ifb:prefix_cache_disk_misses_total") == HIT_TOKENS  # cold: found nowhere
    assert second.health_report().body["kv_cache"]["prefix_cache_disk_hit_tokens"] == HIT_TOKENS


def test_an_evicted_prefix_comes_back_from_disk(tiny_llama_engine: Path, prompt: list[int], tmp_path: Path) -> None:
    """In a 10-block pool, another long prompt evicts the first one's cached blocks (spilled as
    they go); the first prompt again hits all 6 from the tier, with the same tokens."""
    other = prompts(EngineConfig.load(tiny_llama_engine, verify=False).spec.vocab_size, [150], seed=22)[0]
    llm = LLM(tiny_llama_engine, prefix_cache_dir=str(tmp_path), kv_blocks=10)
    try:
        cold = list(llm.generate(prompt, GREEDY)[0].token_ids)
        llm.generate(other, GREEDY)  # 158 tokens: all 10 blocks
        assert llm.stats().kv.disk.hit_tokens == 0
        again = list(llm.generate(prompt, GREEDY)[0].token_ids)
        kv = llm.stats().kv
    finally:
        llm.close()
    assert again == cold
    assert kv.disk.hit_tokens == HIT_TOKENS and kv.prefix_cache_hit_tokens == HIT_TOKENS


def test_a_flipped_byte_is_refused_counted_and_removed(
    tiny_llama_engine: Path, prompt: list[int], tmp_path: Path
) -> None:
    """Block 0's file with one byte flipped: refused (counted, removed), the chain stops there,
    and the prompt is computed cold: the same tokens."""
    cold, _ = serve_once(tiny_llama_engine, tmp_path, prompt)
    build_id = EngineConfig.load(tiny_llama_engine, verify=False).build_id
    path = tmp_path / block_file_name(build_id, prefix_block_keys(prompt, BLOCK, None)[0])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(data)
    warm, second = serve_once(tiny_llama_engine, tmp_path, prompt)
    disk = second.stats().kv.disk
    assert warm == cold
    assert (disk.rejected_files, disk.hit_tokens, second.stats().kv.prefix_cache_hit_tokens) == (1, 0, 0)
    assert metric(second, "ifb:prefix_cache_disk_rejected_files_total") == 1
    assert path.exists() is False or path.read_bytes() != bytes(data)  # removed (then written afresh at stop)


def test_another_build_never_hits(tiny_llama_engine: Path, prompt: list[int], tmp_path: Path) -> None:
    """The same weights under another build id, on the same directory: the first engine's
    blocks would be bit-for-bit right, yet they are not its own, so it neither hits nor reads them."""
    cold, _ = serve_once(tiny_llama_engine, tmp_path / "tier", prompt)
    theirs = block_files(tmp_path / "tier")
    copy = tmp_path / "engine-copy"
    shutil.copytree(tiny_llama_engine, copy)
    record = json.loads((copy / "engine.json").read_text())
    record["build_id"] = "another-build"
    record[RECORD_SHA256] = record_sha256(record)
    (copy / "engine.json").write_text(json.dumps(record))
    tokens, other = serve_once(copy, tmp_path / "tier", prompt)
    disk = other.stats().kv.disk
    assert tokens == cold
    assert (disk.hit_tokens, disk.bytes_read, disk.rejected_files) == (0, 0, 0)
    assert other.stats().kv.prefix_cache_hit_tokens == 0
    assert theirs < block_files(tmp_path / "tier")  # the first engine's files are still there, beside its own
