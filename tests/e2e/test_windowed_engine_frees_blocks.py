"""Freeing the KV blocks that slid out of the window, end to end, on tiny windowed models.

Pins, on a dense fp32 engine of a random Mistral's HF folder (its torch attention gathers every
block of the table, holes included, and masks) and on the engine of a Q8_0 file llama.cpp's own
converter wrote of a trained-like Phi-3 (the decode kernel, which starts at the window): with
every layer sliding (window 20, blocks of 16), a request of 240 tokens (15 blocks) runs on a
pool of 13 (12 usable beside the null block), holding at most 4 blocks at once
(ceil((24 + 20 - 1) / 16) + 1, steps of 24 tokens), and its greedy tokens are transformers' fp32.
Three such requests run together in that pool, each as it runs alone and as transformers; and a
prompt whose prefix another request computed reuses those blocks (matched from the right: the
entries the window no longer reads are holes from the start) and still equals transformers. Without freeing, admission refuses each request whole
(15 blocks > 13), so every test here fails; freeing a block one position early fails too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from family_checks import oracle, rounded_as
from greedy_loop import hf_greedy
from llama_cpp_converter import convert
from sharp_models import write_sharp_checkpoint
from step_cases import prompts
from tiny_models import TINY_LIMITS, write_hf_checkpoint

from ifb import LLM
from ifb.builder.build import BuildOptions, build_engine
from ifb.runtime.executor import StepRecord
from ifb.runtime.sampling_params import SamplingParams

WINDOW = 20  # a block and a quarter: window edges fall inside blocks
BLOCK = TINY_LIMITS["block_size"]  # 16
# Steps of 24 tokens (a block's chunk beside decodes); 13 blocks, so no 240-token sequence (15
# blocks) fits whole.
SETTINGS = {"kv_blocks": 13, "max_num_tokens": 24, "queue_timeout": 120.0}  # never seated: refused, not hung
PEAK_BLOCKS = -(-(SETTINGS["max_num_tokens"] + WINDOW - 1) // BLOCK) + 1  # 4


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny-mistral"), "mistral", seed=21, sliding_window=WINDOW)


@pytest.fixture(scope="module", params=["dense_fp32", "llama_cpp_q8_0"])
def engine_and_oracle(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, mistral_dir: Path
) -> tuple[Path, torch.nn.Module]:
    """The dense engine (its torch attention gathers every table entry, holes included, and
    masks) of the Mistral folder, or the engine of a Q8_0 file llama.cpp's converter wrote (the
    decode kernel, which starts reading at the window) of a trained-like Phi-3 with the same
    window on every layer (llama.cpp writes a window for Phi-3, never for a Mistral); each with
    transformers on its HF folder (for the file: 2-D weights rounded through Q8_0 as it holds them)."""
    folder = tmp_path_factory.mktemp("engines")
    if request.param == "dense_fp32":
        source: Path = mistral_dir
        oracle_model = oracle(mistral_dir)
    else:
        phi3 = write_sharp_checkpoint(folder / "phi3", "phi3", seed=21, sliding_window=WINDOW)
        source = convert(phi3, folder / "phi3-q8_0.gguf", "q8_0")
        oracle_model = rounded_as(oracle(phi3), source)
    build_engine(source, folder / "engine", BuildOptions(dtype="fp32", compute="fp32", **TINY_LIMITS))
    assert oracle_model.config.sliding_window == WINDOW
    return folder / "engine", oracle_model


@pytest.fixture
def hf(engine_and_oracle: tuple[Path, torch.nn.Module]) -> torch.nn.Module:
    return engine_and_oracle[1]


@pytest.fixture
def llm(engine_and_oracle: tuple[Path, torch.nn.Module]) -> Iterator[LLM]:
    with LLM(engine_and_oracle[0], **SETTINGS) as llm:
        yield llm


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _record_steps(llm: LLM) -> list[StepRecord]:
    steps: list[StepRecord] = []
    llm.executor.step_listeners.append(steps.append)
    return steps


def _assert_pool_drained(llm: LLM) -> None:
    """Integrity, and every usable block free again (the null block is not among them)."""
    llm.executor.scheduler.check_integrity()
    kv = llm.stats().kv
    assert (kv.num_blocks, kv.num_free_blocks, kv.num_used_blocks) == (SETTINGS["kv_blocks"] - 1, 12, 0)


def test_a_request_longer_than_the_pool_holds_its_window_and_equals_transformers(llm: LLM, hf: torch.nn.Module) -> None:
    """40 + 200 tokens (15 blocks) in a pool of 12 usable; the greedy tokens are transformers'.
    After each step it holds the blocks of its live keys, n - 19 .. n - 1: at most 3 (4 while a
    step's chunk is added)."""
    prompt = prompts(llm.engine_config.spec.vocab_size, [40], seed=3)[0]
    steps = _record_steps(llm)
    output = llm.generate(prompt, _greedy(200))[0]
    assert list(output.token_ids) == hf_greedy(hf, prompt, 200)
    assert max(s.num_used_blocks for s in steps) == 3
    _assert_pool_drained(llm)


def test_requests_run_together_past_the_window_each_as_alone_and_as_transformers(llm: LLM, hf: torch.nn.Module) -> None:
    """Three requests of 15 blocks each (45 in all) in 12 usable blocks run in the same steps
    (guaranteed_no_evict seats all three: peaks 3 x 4 = 12); each equals itself alone and
    transformers."""
    texts = prompts(llm.engine_config.spec.vocab_size, [40, 33, 47], seed=5)
    lengths = [200, 207, 193]  # 240 tokens each
    steps = _record_steps(llm)
    together = [list(o.token_ids) for o in llm.generate(texts, [_greedy(n) for n in lengths])]
    assert max(s.num_requests for s in steps) == 3
    assert max(s.num_used_blocks for s in steps) <= 3 * PEAK_BLOCKS
    alone = [list(llm.generate(text, _greedy(n))[0].token_ids) for text, n in zip(texts, lengths, strict=True)]
    assert together == alone
    assert together == [hf_greedy(hf, text, n) for text, n in zip(texts, lengths, strict=True)]
    _assert_pool_drained(llm)


def test_a_reused_prefix_past_the_window_equals_transformers(llm: LLM, hf: torch.nn.Module) -> None:
    """A computes a 64-token prefix (its first 3 blocks slide out but stay cached); B, the same
    prefix then 20 tokens of its own, hits all 64 tokens (blocks 0-1, which a query at 64 no
    longer reads, as holes; 2-3 shared), and generates 150 tokens past the window as
    transformers does."""
    vocab = llm.engine_config.spec.vocab_size
    shared, own_a, own_b = prompts(vocab, [64, 6, 20], seed=8)
    llm.generate(shared + own_a, _greedy(8))
    before = llm.stats().kv.prefix_cache_hit_tokens
    output = llm.generate(shared + own_b, _greedy(150))[0]
    assert llm.stats().kv.prefix_cache_hit_tokens - before == 64
    assert list(output.token_ids) == hf_greedy(hf, shared + own_b, 150)
    _assert_pool_drained(llm)
