"""A layer-chunked block engine (#39): its step compiles one chunk of alike layers, run as one
container per chunk, and gives the unrolled step's logits bit for bit.

The model is a tiny Gemma 3 of 24 layers, three sliding layers then a global one, six times (so
chunks of 4 or 8 layers repeat; `--layer-chunks on`, since at its size `auto` leaves a step
unrolled: builder/layer_chunk_plan.py): every part a chunk must carry is in it — local and global RoPE tables, the
windowed and the full attention, sandwich norms, a scaled embedding — and its tied Q8_0 embedding
shares the head's tiles, so the eager embedding reads tiles the head's package also binds.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_models import TINY_LIMITS, write_hf_checkpoint

from ifb.builder.build import BuildOptions, build_engine
from ifb.builder.compile_cpu import compile_cpu_engine
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.step.backend import NetworkStep, StepMode
from ifb.runtime.step.chunked_step import ChunkedAotiStep
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

LAYERS, WINDOW, PERIOD = 24, 8, ["sliding_attention"] * 3 + ["full_attention"]
UNROLLED = "unrolled-step.pt2"


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    checkpoint = write_hf_checkpoint(
        tmp_path_factory.mktemp("deep-gemma3"),
        "gemma3_text",
        seed=5,
        num_hidden_layers=LAYERS,
        sliding_window=WINDOW,
        layer_types=PERIOD * (LAYERS // len(PERIOD)),
    )
    output = tmp_path_factory.mktemp("engines") / "deep-gemma3-q8_0"
    build_engine(
        checkpoint,
        output,
        BuildOptions(
            dtype="fp32", weights="q8_0", compute="fp32", calibration="serve", layer_chunks="on", **TINY_LIMITS
        ),
    )
    return output


@pytest.fixture(scope="module")
def unrolled_config(engine_dir: Path) -> EngineConfig:
    """The same engine with the whole step as one unrolled package, compiled here from its network."""
    eager = Engine.load(engine_dir, StepMode.EAGER)  # loads the kernel library the package links
    assert isinstance(eager.backend, NetworkStep)
    config = eager.config
    compile_cpu_engine(
        eager.backend.network,
        config.limits,
        eager.kv_cache,
        engine_dir / UNROLLED,
        constants_in_package=False,
        kernels=config.kernels,
    )
    return replace(config, step_package=UNROLLED, layer_chunks=())


def test_the_alike_layers_compile_once_and_run_as_chunks(engine_dir: Path) -> None:
    config = EngineConfig.load(engine_dir)
    chunks = config.layer_chunks
    assert len(chunks) > 1 and len({chunk.package for chunk in chunks}) == 1
    assert chunks[0].num_layers % len(PERIOD) == 0  # whole periods of the sliding/global pattern
    assert [c.first_layer for c in chunks] == [sum(c.num_layers for c in chunks[:i]) for i in range(len(chunks))]
    assert sum(chunk.num_layers for chunk in chunks) == LAYERS
    assert isinstance(Engine(config).backend, ChunkedAotiStep)


def test_a_chunked_step_gives_the_unrolled_steps_logits_bit_for_bit(
    engine_dir: Path, unrolled_config: EngineConfig
) -> None:
    chunked, unrolled = Engine.load(engine_dir), Engine(unrolled_config)
    vocab, bs = chunked.config.spec.vocab_size, chunked.config.limits.block_size
    long_prompt = [(3 + 11 * i) % vocab for i in range(3 * WINDOW + 5)]  # past the sliding window
    short_prompt = [(7 + 13 * i) % vocab for i in range(5)]
    steps = [
        [RequestSlice(long_prompt[:20], 0, [0, 1], True), RequestSlice(short_prompt, 0, [5], True)],
        [RequestSlice(long_prompt[20:], 20, [0, 1], True), RequestSlice([17], 5, [5], True)],
        *([RequestSlice([11 + n], len(long_prompt) + n, [0, 1, 2], True)] for n in range(4)),
    ]
    for index, slices in enumerate(steps):
        inputs = build_step_inputs(slices, bs)
        ours, theirs = chunked.step(inputs), unrolled.step(inputs)
        assert torch.equal(ours, theirs), f"step {index}: max |diff| {(ours - theirs).abs().max().item():.3g}"
    assert torch.equal(chunked.kv_cache, unrolled.kv_cache)  # every layer's K/V written alike
