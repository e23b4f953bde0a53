"""The ONNX graph the TensorRT backend builds from, run by onnxruntime on the CPU in every CI run."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
import torch
from onnx.external_data_helper import uses_external_data
from step_cases import FP32_TOLERANCE, run_mixed_step

from ifb.builder.export_onnx import ONNX_OPSET, export_onnx, external_data_path
from ifb.runtime.engine_format import STEP_INPUTS, dimension_bounds
from ifb.runtime.step.backend import StepMode, load_network
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.onnx_step import OnnxStep


@pytest.fixture(scope="module")
def onnx_path(tiny_llama_engine: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    engine = Engine.load(tiny_llama_engine, StepMode.REFERENCE)
    network = load_network(engine.config, reference_ops=False)
    return export_onnx(network, engine.config.limits, engine.kv_cache, tmp_path_factory.mktemp("onnx") / "step.onnx")


def _graph(onnx_path: Path) -> onnx.ModelProto:
    """The graph alone: the weights stay in the side file."""
    return onnx.load(str(onnx_path), load_external_data=False)


def test_onnxruntime_matches_the_torch_reference_on_mixed_steps(tiny_llama_engine: Path, onnx_path: Path) -> None:
    """Warm-up then a step mixing two prefill chunks and two decodes over scattered blocks; the
    graph's weights come from its side file (the path every model takes, past 2 GB included)."""
    reference = Engine.load(tiny_llama_engine, StepMode.REFERENCE)
    via_onnx = Engine.load(tiny_llama_engine, StepMode.REFERENCE)
    via_onnx.backend = OnnxStep(onnx_path)  # same Engine, the ONNX graph as its step
    expected, actual = run_mixed_step(reference), run_mixed_step(via_onnx)
    assert actual.shape == expected.shape == (4, reference.config.spec.vocab_size)
    assert (actual - expected).abs().max().item() < FP32_TOLERANCE
    assert (via_onnx.kv_cache - reference.kv_cache).abs().max().item() < 1e-5


def test_weights_live_in_a_side_file_next_to_the_graph(tiny_llama_engine: Path, onnx_path: Path) -> None:
    """Every weight tensor is external, in `step.onnx.data`, named relative to the graph's folder
    (how onnxruntime and TensorRT's parse_from_file find it); only tensors of at most 256 bytes
    (scalars, shapes, the tiny model's norm weights) stay in the graph file."""
    model = _graph(onnx_path)
    data_file = external_data_path(onnx_path)
    assert data_file == onnx_path.parent / "step.onnx.data" and data_file.is_file()
    external = [t for t in model.graph.initializer if uses_external_data(t)]
    inline = [t for t in model.graph.initializer if not uses_external_data(t)]
    assert {e.value for t in external for e in t.external_data if e.key == "location"} == {data_file.name}
    assert "network.embed.weight" in {t.name for t in external}
    assert max(len(t.raw_data) for t in inline) <= 256
    weights_file = Engine.load(tiny_llama_engine, StepMode.REFERENCE).config.weights_path
    assert data_file.stat().st_size >= 0.9 * weights_file.stat().st_size  # all of them are there


def test_the_opset_is_pinned_to_what_tensorrt_parses(onnx_path: Path) -> None:
    """The default-domain opset is the pinned one (not torch's default, which moves with torch)."""
    opsets = {entry.domain: entry.version for entry in _graph(onnx_path).opset_import}
    assert opsets.get("", opsets.get("ai.onnx")) == ONNX_OPSET == 18


def test_onnx_dimensions_are_dynamic_and_bounded_by_the_baked_limits(tiny_llama_engine: Path, onnx_path: Path) -> None:
    model = _graph(onnx_path)
    limits = Engine.load(tiny_llama_engine, StepMode.REFERENCE).config.limits
    bounds = {
        p.key.removeprefix("ifb.bounds."): tuple(json.loads(p.value))
        for p in model.metadata_props
        if p.key.startswith("ifb.bounds.")
    }
    assert bounds == dimension_bounds(limits)
    assert bounds["num_tokens"] == (1, limits.max_num_tokens) and bounds["num_decode"] == (0, limits.max_batch_size)
    shapes = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert all(
        isinstance(d, str) for d in shapes["input_ids"] + shapes["context_query_rows"] + shapes["decode_block_tables"]
    )
    assert shapes["kv_pools_0"] == [limits.kv_pool_tokens, 2, 16]  # the pool is static: baked at build


def test_greedy_through_onnxruntime_equals_the_compiled_engine(tiny_llama_engine: Path, onnx_path: Path) -> None:
    from greedy_loop import greedy_generate

    compiled = Engine.load(tiny_llama_engine, StepMode.COMPILED)
    via_onnx = Engine.load(tiny_llama_engine, StepMode.REFERENCE)
    via_onnx.backend = OnnxStep(onnx_path)
    prompt = torch.arange(3, 40).tolist()
    assert greedy_generate(via_onnx, prompt, 16, chunk=16) == greedy_generate(compiled, prompt, 16, chunk=16)


def test_tensorrt_profile_covers_every_dynamic_input_with_the_graphs_own_dimensions(
    tiny_llama_engine: Path, onnx_path: Path
) -> None:
    """The optimization profile TensorRT gets: one (min, opt, max) per dynamic graph input, with the
    baked limits as max, and one graph symbol per named dimension (so shapes agree across inputs)."""
    from ifb.builder.compile_tensorrt import profile_shapes

    limits = Engine.load(tiny_llama_engine, StepMode.REFERENCE).config.limits
    profile = profile_shapes(limits)
    model = _graph(onnx_path)
    graph_dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    dynamic_inputs = {name for name, dims in graph_dims.items() if any(isinstance(d, str) for d in dims)}
    assert set(profile) == dynamic_inputs
    bounds = dimension_bounds(limits)
    symbol_of: dict[str, str] = {}
    for name, dims in ((tensor.name, tensor.dims) for tensor in STEP_INPUTS):
        low, opt, high = profile[name]
        assert len(low) == len(opt) == len(high) == len(graph_dims[name]) == len(dims)
        for dim, symbol, a, b, c in zip(dims, graph_dims[name], low, opt, high, strict=True):
            assert (a, c) == bounds[dim] and a <= b <= c
            assert symbol_of.setdefault(dim, str(symbol)) == symbol, f"{name}: {dim} is a different graph symbol"
    assert len(set(symbol_of.values())) == len(symbol_of)  # distinct dimensions stay distinct
    assert profile["decode_block_tables"][2] == (limits.max_batch_size, limits.max_blocks_per_seq)
