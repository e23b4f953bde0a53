"""The layer-chunk plan (builder/layer_chunk_plan.py): which runs of layers a block engine's step
compiles once, from the layers' signatures, as llama.cpp's quantizer leaves them; and the chunks
as engine.json keeps them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from engine_records import SPEC, engine_config

from ifb.builder.layer_chunk_plan import (
    BYTES_PER_RUN,
    HEAD_SECONDS,
    HELPER_START_SECONDS,
    MAX_RUNS,
    ChunkPlan,
    LayerChunking,
    estimated_seconds,
    package_seconds,
    plan_layer_chunks,
    split_packages,
    unrolled_seconds,
)
from ifb.runtime.engine_format import EngineConfig, LayerChunk
from ifb.runtime.errors import EngineFormatError

SMALL = 70 * 2**20  # SmolLM2's layers' bytes, about: under BYTES_PER_RUN
LAYER_BYTES_1B = 34 * 2**20  # a 1B Llama's Q4_K_M decoder layer, about


def q4_k_m_layers(num_layers: int) -> list[str]:
    """Which layers llama.cpp's Q4_K_M keeps attn_v and ffn_down in Q6_K (its use_more_bits):
    "m" those, "n" the others."""
    eighth = num_layers // 8
    return ["m" if i < eighth or i >= 7 * num_layers // 8 or (i - eighth) % 3 == 2 else "n" for i in range(num_layers)]


def assert_sound(plan: ChunkPlan, signatures: list[str], max_runs: int) -> None:
    """Every layer once, in order; chunks sharing a package have the same layers."""
    assert [first for first, _ in plan.chunks] == [sum(n for _, n in plan.chunks[:i]) for i in range(len(plan.chunks))]
    assert sum(count for _, count in plan.chunks) == len(signatures)
    assert len(plan.chunks) <= max_runs
    layers_of: dict[int, list[str]] = {}
    for (first, count), package in zip(plan.chunks, plan.packages, strict=True):
        assert layers_of.setdefault(package, signatures[first : first + count]) == signatures[first : first + count]


def test_alike_layers_compile_in_about_the_same_time_whatever_the_depth() -> None:
    """#39's bar: a 16- and a 48-layer model of the same width (a 1B's) compile within 20% of each
    other. The 16 layers stay unrolled (chunks would not cut a third), deeper ones chunk."""
    estimates = []
    for depth in (16, 30, 48):
        plan = plan_layer_chunks(["a"] * depth, depth * LAYER_BYTES_1B, workers=2)
        assert (plan is None) == (depth == 16)
        if plan is not None:
            assert_sound(plan, ["a"] * depth, min(MAX_RUNS, depth * LAYER_BYTES_1B // BYTES_PER_RUN))
            assert plan.num_packages == 1
        estimates.append(unrolled_seconds(depth) if plan is None else estimated_seconds(plan, 2))
    assert max(estimates) <= 1.2 * estimates[0]  # depth adds no compile time (measured: bench/README)


def test_a_small_model_stays_unrolled_unless_chunks_are_asked_for() -> None:
    """SmolLM2's 30 alike layers: a chunk would cost its ~6 ms decode step more than 2%."""
    assert plan_layer_chunks(["a"] * 30, SMALL) is None
    plan = plan_layer_chunks(["a"] * 30, SMALL, LayerChunking.ON)
    assert plan is not None and plan.num_packages == 1 and 2 <= len(plan.chunks) <= MAX_RUNS
    assert plan_layer_chunks(["a"] * 30, 1 << 40, LayerChunking.OFF) is None


def test_a_deep_q4_k_m_file_compiles_two_chunk_packages_of_its_period() -> None:
    signatures = q4_k_m_layers(48)
    plan = plan_layer_chunks(signatures, 48 * LAYER_BYTES_1B)
    assert plan is not None
    assert_sound(plan, signatures, MAX_RUNS)
    assert plan.num_packages == 2  # six Q6_K layers at either end; (Q4_K, Q4_K, Q6_K) twice between
    assert {count for _, count in plan.chunks} == {6}
    assert estimated_seconds(plan) < 0.8 * unrolled_seconds(48)


def test_the_runs_are_capped_by_the_layers_bytes() -> None:
    signatures = ["a"] * 48
    small, large = plan_layer_chunks(signatures, 3 * BYTES_PER_RUN), plan_layer_chunks(signatures, 1 << 40)
    assert small is not None and large is not None
    assert len(small.chunks) <= 3 < len(large.chunks) <= MAX_RUNS
    assert estimated_seconds(large) < estimated_seconds(small)  # more runs buy shorter chunks
    middle = plan_layer_chunks(signatures, 5 * BYTES_PER_RUN)
    assert middle is not None and len(middle.chunks) <= 5


@pytest.mark.parametrize(
    "signatures", [["a", "a"], ["a"] * 12, list("abcdefghijklmnop"), q4_k_m_layers(16), q4_k_m_layers(30)]
)
def test_no_chunking_where_it_would_not_save_a_fifth(signatures: list[str]) -> None:
    """Shallow models, layers all different, and Q4_K_M files up to 30 layers (two chunk packages
    and the head cost about what their unrolled layers do): the unrolled step compiles as fast."""
    assert plan_layer_chunks(signatures, len(signatures) * LAYER_BYTES_1B) is None


def test_engine_json_keeps_the_chunks_and_refuses_ones_that_skip_or_repeat_layers(tmp_path: Path) -> None:
    spec = replace(SPEC, num_layers=6)
    chunks = (LayerChunk("layers-0.pt2", 0, 3), LayerChunk("layers-0.pt2", 3, 3))
    config = engine_config(spec=spec, layer_chunks=chunks)
    assert EngineConfig.from_json(config.to_json(), tmp_path).layer_chunks == chunks
    for bad in ((chunks[0], chunks[0]), chunks[:1], (chunks[1], chunks[0]), (LayerChunk("a.pt2", 0, 0), *chunks)):
        record = engine_config(spec=spec, layer_chunks=bad).to_json()
        with pytest.raises(EngineFormatError, match="layer_chunks"):
            EngineConfig.from_json(record, tmp_path)
    escaping = engine_config(spec=spec, layer_chunks=(LayerChunk("../x.pt2", 0, 6),))
    with pytest.raises(EngineFormatError, match="layer_chunks.package"):
        _ = EngineConfig.from_json(escaping.to_json(), tmp_path).layer_chunk_paths


def test_a_helper_process_takes_packages_only_where_that_is_estimated_faster() -> None:
    """Longest first, each to the process that ends it first; the helper starts late."""
    assert split_packages([20.0, 6.0], 1) == ([0, 1], [])
    assert split_packages([20.0], 2) == ([0], [])
    assert split_packages([20.0, 20.0, 6.0], 2) == ([0, 2], [1])
    # a package shorter than the helper's start is not worth a process
    assert split_packages([20.0, HELPER_START_SECONDS / 2], 2) == ([0, 1], [])
    local, helper = split_packages([17.0, 17.0, 6.0], 2)
    assert sorted(local + helper) == [0, 1, 2] and helper


def test_a_helper_makes_a_deep_q4_k_m_file_compile_in_about_a_shallow_ones_time() -> None:
    """#39's bar for the files people download: a 48-layer Q4_K_M (two chunk packages and the head)
    against the same width's 16 layers unrolled, within 20% with a helper process."""
    signatures = q4_k_m_layers(48)
    alone = plan_layer_chunks(signatures, 48 * LAYER_BYTES_1B, workers=1)
    together = plan_layer_chunks(signatures, 48 * LAYER_BYTES_1B, workers=2)
    assert alone is not None and together is not None
    assert_sound(together, signatures, MAX_RUNS)
    assert estimated_seconds(together, 2) < estimated_seconds(alone, 1)
    assert estimated_seconds(together, 2) <= 1.2 * unrolled_seconds(16)
    assert package_seconds(together)[-1] == HEAD_SECONDS  # the head's package, last
