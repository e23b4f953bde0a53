"""WeightFormat is the one list of block formats, from the builder's options to the C++ kernels.

Pins: the C++ table (csrc/block_format_table.h) is what `python -m ifb.plugins.quant_formats`
generates from the enum, and the C++ sources spell no format of their own: Format, kFormats and
the format switch expand from that table; each layout is GGUF's; `--weights`' block choices are
what `quantize` writes, and engine.json's weight_formats accepts exactly the enum's values, so
the on-disk names stay what older engines hold. The compiled library's side of the table is
checked in test_quant_kernels.py (every format's tiles dequantize through the library).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import pytest
import torch
from engine_records import engine_config

from ifb.builder.quant_weights import BLOCK_CHOICES, WEIGHT_CHOICES
from ifb.plugins import quant_ops
from ifb.plugins.quant_formats import (
    BLOCK_FORMATS,
    GGUF_TYPE_NAMES,
    QUANTIZE_FORMATS,
    WeightCompute,
    WeightFormat,
    block_bytes,
    block_weights,
    dequantize,
    kernel_format_table,
    quantize,
)
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.engine_format.config import STORED_WEIGHT_FORMATS
from ifb.runtime.errors import EngineFormatError

CSRC = Path(__file__).resolve().parents[2] / "plugins" / "csrc"
TABLE = CSRC / "block_format_table.h"


def test_the_kernels_table_is_generated_from_the_enum() -> None:
    assert TABLE.read_text() == kernel_format_table(), (
        "plugins/csrc/block_format_table.h is stale: run `python -m ifb.plugins.quant_formats`"
    )


def test_the_table_lists_every_block_format_in_the_enum_order() -> None:
    rows = re.findall(r'X\((\w+), "(\w+)", (\d+), (\d+)\)', TABLE.read_text())
    expected = [(fmt.name, fmt.value, str(block_bytes(fmt)), str(block_weights(fmt))) for fmt in BLOCK_FORMATS]
    assert rows == expected
    assert [fmt for fmt in WeightFormat if fmt.is_block] == list(BLOCK_FORMATS) and not WeightFormat.FP32.is_block


def test_no_cxx_source_spells_a_format_of_its_own() -> None:
    """Names, the Format enumerators, kFormats and the switch come from the table, nowhere else."""
    names = {fmt.value for fmt in BLOCK_FORMATS}
    for source in sorted(CSRC.glob("*.[ch]*")):
        if source == TABLE:
            continue
        text = source.read_text()
        assert not names & set(re.findall(r'"(\w+)"', text)), f"{source.name} spells a format name"
        assert not re.search(r"case Format::k\w+\s*:", text), f"{source.name} has a hand-written format case"
    kernels = (CSRC / "quant_kernels.h").read_text()
    assert re.search(r"enum class Format : int32_t \{\s*#define \w+\(id, name, bytes, weights\) k##id,", kernels)
    assert "IFB_BLOCK_FORMATS(IFB_FORMAT_ENUMERATOR)" in kernels and "IFB_BLOCK_FORMATS(IFB_FORMAT_INFO)" in kernels
    assert "IFB_BLOCK_FORMATS(IFB_FORMAT_CASE)" in (CSRC / "block_formats.h").read_text()


def test_each_layout_is_gguf_s() -> None:
    assert set(GGUF_TYPE_NAMES) == {fmt.name for fmt in BLOCK_FORMATS}
    for name, fmt in GGUF_TYPE_NAMES.items():
        weights, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert (block_weights(fmt), block_bytes(fmt)) == (weights, size), name
    with pytest.raises(ValueError, match="fp32 is not a block format"):
        block_bytes(WeightFormat.FP32)


def test_weights_choices_are_what_quantize_writes() -> None:
    assert BLOCK_CHOICES == ("q8_0", "q4_1", "q4_0")  # the order `ifb build --help` lists them in
    assert WEIGHT_CHOICES == ("auto", "fp32", *BLOCK_CHOICES)
    assert BLOCK_CHOICES == tuple(fmt.value for fmt in QUANTIZE_FORMATS)
    weight = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    for fmt in BLOCK_FORMATS:
        if fmt.quantizable:
            blocks = quantize(weight, fmt)
            assert blocks.shape == (3, 64 // block_weights(fmt) * block_bytes(fmt))
            assert (dequantize(blocks, fmt) - weight).abs().max() <= weight.abs().max() / 7  # half a 4-bit step
        else:
            with pytest.raises(ValueError, match="quantize writes Q4_0, Q4_1 and Q8_0 only"):
                quantize(weight, fmt)


def test_the_ops_take_the_enum_value() -> None:
    assert [quant_ops.kernel_format(fmt) for fmt in BLOCK_FORMATS] == [fmt.value for fmt in BLOCK_FORMATS]
    with pytest.raises(ValueError, match="block formats only, not fp32"):
        quant_ops.kernel_format(WeightFormat.FP32)


def test_engine_json_keeps_the_format_names(tmp_path: Path) -> None:
    """weight_formats is written and read as the enum's values ("q4_k", ...), as older engines hold them."""
    assert STORED_WEIGHT_FORMATS == tuple(fmt.value for fmt in WeightFormat)
    formats = {"layers.0.attn.qkv[0]": "q4_k", "layers.0.attn.qkv[2]": "fp32", "lm_head": "q6_k", "embed": "q8_0"}
    typed = {name: WeightFormat(fmt) for name, fmt in formats.items()}
    record = engine_config(weight_formats=typed, weight_compute=WeightCompute.INT8).to_json()
    assert record["weight_formats"] == formats and record["weight_compute"] == "int8"
    assert json.loads(json.dumps(record))["weight_formats"] == formats
    loaded = EngineConfig.from_json(record, tmp_path)
    assert loaded.weight_formats == typed and loaded.weight_compute is WeightCompute.INT8
    assert all(type(fmt) is WeightFormat for fmt in loaded.weight_formats.values())
    with pytest.raises(EngineFormatError, match="weight_formats .*'q2_k'"):
        EngineConfig.from_json({**record, "weight_formats": {"lm_head": "q2_k"}}, tmp_path)
