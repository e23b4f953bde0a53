"""Every GGUF tensor and metadata key is accounted for: read, named in one warning, or refused.

The files are the converter double's (tests/tiny_models.write_gguf) with keys and tensors added
or swapped by `rewrite`: what they pin is the builder's reading of a key or tensor llama.cpp's
converter would write (or a stranger one), not a conversion. The RoPE scaling end to end, with
llama.cpp's own converter and transformers on the HF folder, is tests/e2e/test_converter_conformance.py (its llama-llama3, llama-linear and qwen3-yarn cases).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tiny_models import write_gguf, write_hf_checkpoint

from ifb.builder.errors import SourceError, UnsupportedModelError
from ifb.builder.gguf_tensors import GgufTensors
from ifb.builder.hf_config import model_spec_from_hf_config
from ifb.builder.rope import rope_tables
from ifb.builder.sources import gguf_config
from ifb.builder.weight_loader import network_state, plan_weights, warn_dequantized
from ifb.plugins import quant_ops
from ifb.plugins.quant_formats import WeightCompute, WeightFormat, dequantize

V = gguf.GGUFValueType
HEAD_DIM = 16  # tiny_config: 64 wide, 4 heads
THETA = 10000.0
# intermediate 256 so ffn_down's rows hold whole 256-weight K-blocks (Q8_K)
OVERRIDES = dict(intermediate_size=256)


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    write_hf_checkpoint(folder / "hf", "llama", **OVERRIDES)
    return write_gguf(folder / "llama.gguf", folder / "hf")


def rewrite(
    source: Path,
    out: Path,
    fields: dict[str, tuple[Any, gguf.GGUFValueType]] | None = None,
    tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]] | None = None,
    drop: tuple[str, ...] = (),
) -> Path:
    """`source` with `fields` and `tensors` added (a tensor of the same name replaced) and the
    keys/tensors in `drop` left out."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop:
            continue
        sub_type = field.types[-1] if field.types[0] == V.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for key, (value, vtype) in (fields or {}).items():
        writer.add_key_value(key, value, vtype, sub_type=V.INT32 if vtype == V.ARRAY else None)
    added = dict(tensors or {})
    for tensor in reader.tensors:
        if tensor.name in drop or tensor.name in added:
            continue
        raw = None if tensor.tensor_type.name in ("F32", "F16") else tensor.tensor_type
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=raw)
    for name, (array, raw_type) in added.items():
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def default_inv_freq() -> torch.Tensor:
    return 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))


def test_mixture_of_experts_llama_reads_as_mixtral(llama_gguf: Path, tmp_path: Path) -> None:
    """A Mixtral-style `llama` file (expert keys, stacked expert tensors, no dense MLP) is read as
    the Mixtral it is (builder/families/mixtral.py; tests/e2e/test_moe_mixtral.py runs one), not
    refused for the dense tensors it lacks; with a shared expert beside them it is refused by name."""
    experts = {
        f"blk.0.ffn_{part}_exps.weight": (np.zeros((4, 64, 256) if part != "down" else (4, 256, 64), np.float32), None)
        for part in ("gate", "up", "down")
    }
    experts["blk.0.ffn_gate_inp.weight"] = (np.zeros((4, 64), np.float32), None)
    path = rewrite(
        llama_gguf,
        tmp_path / "moe.gguf",
        fields={"llama.expert_count": (4, V.UINT32), "llama.expert_used_count": (2, V.UINT32)},
        tensors=experts,
        drop=tuple(f"blk.0.ffn_{part}.weight" for part in ("gate", "up", "down")),
    )
    config = gguf_config(path)
    assert (config.model_type, config.num_local_experts, config.num_experts_per_tok) == ("mixtral", 4, 2)
    shared = rewrite(
        path, tmp_path / "shared.gguf", tensors={"blk.0.ffn_up_shexp.weight": experts["blk.0.ffn_gate_inp.weight"]}
    )
    with pytest.raises(UnsupportedModelError, match=r"llama GGUF has shared experts \(blk.0.ffn_up_shexp.weight"):
        gguf_config(shared)


def test_mxfp4_experts_are_kept_as_blocks_as_gguf_reads_them(llama_gguf: Path, tmp_path: Path) -> None:
    """gpt-oss's expert type: a Mixtral-style file whose stacked experts are MXFP4 (written with
    gguf-py's quantizer) keeps them as MXFP4 blocks (no dequantization warning); each expert's
    rows are the file's bytes, dequantize to gguf-py's values bit for bit, and the engine stores
    them packed as the kernels read them, for both compute modes."""
    experts, hidden, width = 4, 64, 256
    rng = np.random.default_rng(3)
    stacked: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]] = {}
    drop = []
    for layer in range(2):
        for part, (rows, cols) in (("gate", (width, hidden)), ("up", (width, hidden)), ("down", (hidden, width))):
            values = rng.normal(0, 0.05, (experts, rows, cols)).astype(np.float32)
            blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.MXFP4)
            stacked[f"blk.{layer}.ffn_{part}_exps.weight"] = (blocks, gguf.GGMLQuantizationType.MXFP4)
            drop.append(f"blk.{layer}.ffn_{part}.weight")
        stacked[f"blk.{layer}.ffn_gate_inp.weight"] = (rng.normal(0, 1, (experts, hidden)).astype(np.float32), None)
    path = rewrite(
        llama_gguf,
        tmp_path / "mxfp4-moe.gguf",
        fields={"llama.expert_count": (experts, V.UINT32), "llama.expert_used_count": (2, V.UINT32)},
        tensors=stacked,
        drop=tuple(drop),
    )
    tensors = _tensors(path)
    assert tensors.info("blk.1.ffn_down_exps.weight").block_format is WeightFormat.MXFP4
    plan = plan_weights(tensors, "auto")
    modules = ("layers.0.mlp.experts_gate_up", "layers.1.mlp.experts_gate_up", "layers.1.mlp.experts_down")
    assert all(plan.formats[module] is WeightFormat.MXFP4 for module in modules)
    assert plan.dequantized == ()
    gate_up = [tensors.expert_block_rows("layers.1.mlp.experts_gate_up", e) for e in range(experts)]
    file_gate, file_up = (stacked[f"blk.1.ffn_{part}_exps.weight"][0] for part in ("gate", "up"))
    for expert, (gate, up) in enumerate(gate_up):
        assert np.array_equal(gate.numpy(), file_gate[expert]) and np.array_equal(up.numpy(), file_up[expert])
        ours = dequantize(torch.cat([gate, up]), WeightFormat.MXFP4).numpy()
        theirs = gguf.quants.dequantize(
            np.concatenate([file_gate[expert], file_up[expert]]), gguf.GGMLQuantizationType.MXFP4
        )
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    for compute, packer in ((WeightCompute.FP32, quant_ops.pack), (WeightCompute.INT8, quant_ops.pack_int8)):
        state = dict(network_state(tensors, plan, compute))
        expected = torch.stack([packer(parts, WeightFormat.MXFP4, 2 * width, hidden) for parts in gate_up])
        assert torch.equal(state["layers.1.mlp.experts_gate_up"], expected), compute


@pytest.mark.parametrize(
    ("key", "value", "vtype"),
    [
        ("llama.rope.scaling.type", "xpos", V.STRING),  # a scaling we do not know
        ("llama.attention.max_alibi_bias", 8.0, V.FLOAT32),  # an attention variant
        ("llama.attention.causal", False, V.BOOL),
        ("llama.logit_scale", 0.5, V.FLOAT32),
        ("llama.rope.dimension_sections", [4, 4, 0, 0], V.ARRAY),  # M-RoPE
        ("llama.rope.scaling.yarn_ext_factor", 0.5, V.FLOAT32),
    ],
)
def test_math_keys_not_understood_are_refused_by_name(
    llama_gguf: Path, tmp_path: Path, key: str, value: Any, vtype: gguf.GGUFValueType
) -> None:
    fields = {key: (value, vtype)}
    if key.endswith("yarn_ext_factor"):  # refused inside an otherwise understood YaRN
        fields |= {
            "llama.rope.scaling.type": ("yarn", V.STRING),
            "llama.rope.scaling.factor": (4.0, V.FLOAT32),
            "llama.rope.scaling.original_context_length": (64, V.UINT32),
        }
    path = rewrite(llama_gguf, tmp_path / "key.gguf", fields=fields)
    with pytest.raises(UnsupportedModelError, match=key.replace(".", r"\.")):
        gguf_config(path)


def test_off_values_and_harmless_keys_pass(llama_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Keys at the value that means "off" are read as such; a key of no known meaning outside the
    math namespaces is named in one warning."""
    fields = {
        "llama.attention.causal": (True, V.BOOL),
        "llama.expert_count": (0, V.UINT32),
        "llama.some_new_flag": (1, V.UINT32),
    }
    path = rewrite(llama_gguf, tmp_path / "ok.gguf", fields=fields)
    with caplog.at_level(logging.WARNING, logger="ifb.builder.gguf_metadata"):
        gguf_config(path)
    messages = [r.getMessage() for r in caplog.records if r.name == "ifb.builder.gguf_metadata"]
    assert len(messages) == 1 and "llama.some_new_flag" in messages[0], messages


@pytest.mark.parametrize("key", ["llama.rope.scaling.factor", "llama.rope.scale_linear"])
def test_linear_scaling_divides_every_frequency(llama_gguf: Path, tmp_path: Path, key: str) -> None:
    """`rope.scaling.type linear` + factor (or the old `rope.scale_linear` alone, which llama.cpp
    also applies as linear) divides each inverse frequency by the factor."""
    fields = {key: (4.0, V.FLOAT32)}
    if key.endswith("factor"):
        fields["llama.rope.scaling.type"] = ("linear", V.STRING)
    config = gguf_config(rewrite(llama_gguf, tmp_path / "linear.gguf", fields=fields))
    inv_freq, attention = rope_tables(config, 256)
    assert torch.allclose(inv_freq, default_inv_freq() / 4, rtol=1e-6, atol=0) and attention == 1.0


def test_yarn_is_transformers_yarn(llama_gguf: Path, tmp_path: Path) -> None:
    """YaRN keys as the converter writes them give transformers' YaRN of the same rope_parameters
    (its ramp, and its attention factor 0.1 ln(factor) + 1 on cos/sin); attn_factor, where the
    file has one, is that factor as the checkpoint set it."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    yarn = {
        "llama.rope.scaling.type": ("yarn", V.STRING),
        "llama.rope.scaling.factor": (4.0, V.FLOAT32),
        "llama.rope.scaling.original_context_length": (64, V.UINT32),
    }
    config = gguf_config(rewrite(llama_gguf, tmp_path / "yarn.gguf", fields=yarn))
    params = {"rope_type": "yarn", "rope_theta": THETA, "factor": 4.0, "original_max_position_embeddings": 64}
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=512, rope_parameters=params)
    expected, expected_attention = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    inv_freq, attention = rope_tables(config, 256)
    assert torch.allclose(inv_freq, expected, rtol=1e-6, atol=0)
    assert math.isclose(attention, 0.1 * math.log(4.0) + 1.0, rel_tol=1e-6) and attention == expected_attention
    assert not torch.allclose(inv_freq, default_inv_freq(), rtol=1e-3)  # the scaling changes the table
    with_attn = rewrite(
        llama_gguf, tmp_path / "yarn_attn.gguf", fields=yarn | {"llama.rope.scaling.attn_factor": (1.5, V.FLOAT32)}
    )
    assert rope_tables(gguf_config(with_attn), 256)[1] == pytest.approx(1.5)


def test_rope_freqs_divide_the_inverse_frequencies(llama_gguf: Path, tmp_path: Path) -> None:
    """llama.cpp's `rope_freqs.weight` (its converter's Llama 3 scaling, no key): freq_i / factor_i,
    and the tensor counts as read (no leftover refusal)."""
    factors = np.array([1, 1, 1.5, 3, 8, 8, 8, 8], dtype=np.float32)
    path = rewrite(llama_gguf, tmp_path / "freqs.gguf", tensors={"rope_freqs.weight": (factors, None)})
    config = gguf_config(path)
    inv_freq, attention = rope_tables(config, 256)
    assert torch.equal(inv_freq, default_inv_freq() / torch.from_numpy(factors)) and attention == 1.0
    GgufTensors(path, model_spec_from_hf_config(config))
    short = rewrite(llama_gguf, tmp_path / "short.gguf", tensors={"rope_freqs.weight": (factors[:4], None)})
    with pytest.raises(UnsupportedModelError, match="rope_freqs has 4 factors"):
        rope_tables(gguf_config(short), 256)


def _tensors(path: Path) -> GgufTensors:
    return GgufTensors(path, model_spec_from_hf_config(gguf_config(path)))


def test_a_tensor_the_network_does_not_apply_is_refused(llama_gguf: Path, tmp_path: Path) -> None:
    path = rewrite(
        llama_gguf, tmp_path / "extra.gguf", tensors={"blk.1.mystery.weight": (np.ones(64, np.float32), None)}
    )
    with pytest.raises(SourceError, match=r"does not apply: blk\.1\.mystery\.weight"):
        _tensors(path)


def test_unneeded_tensors_are_named_in_one_warning(
    llama_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table = (np.ones(8, np.float32), None)
    path = rewrite(
        llama_gguf,
        tmp_path / "rot.gguf",
        tensors={"blk.0.attn_rot_embd.weight": table, "blk.1.attn_rot_embd.weight": table},
    )
    with caplog.at_level(logging.WARNING, logger="ifb.builder.gguf_tensors"):
        _tensors(path)
    messages = [r.getMessage() for r in caplog.records if r.name == "ifb.builder.gguf_tensors"]
    assert len(messages) == 1, messages
    assert "blk.0.attn_rot_embd.weight, blk.1.attn_rot_embd.weight" in messages[0] and "rope.freq_base" in messages[0]


def _q8_k_blocks(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`values` [rows, cols] as Q8_K blocks (uint8 rows: fp32 scale, 256 int8, 16 int16 sums) and
    what they dequantize to."""
    rows, cols = values.shape
    groups = values.reshape(-1, 256)
    scale = (np.abs(groups).max(axis=1, keepdims=True) / 127).astype(np.float32)
    ints = np.round(groups / scale).astype(np.int8)
    sums = ints.reshape(-1, 16, 16).sum(-1).astype(np.int16)
    blocks = np.concatenate([scale.view(np.uint8), ints.view(np.uint8), sums.view(np.uint8)], axis=1)
    return blocks.reshape(rows, -1), (scale * ints).reshape(rows, cols)


def test_q8_k_is_dequantized_with_a_warning(llama_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Q8_K (no kernel, no gguf-py dequantizer: a traceback before) is dequantized, and the build's
    one dequantization warning names the tensor."""
    values = np.random.default_rng(0).normal(0, 0.05, (64, 256)).astype(np.float32)
    blocks, expected = _q8_k_blocks(values)
    qtype = gguf.GGMLQuantizationType.Q8_K
    path = rewrite(llama_gguf, tmp_path / "q8_k.gguf", tensors={"blk.0.ffn_down.weight": (blocks, qtype)})
    tensors = _tensors(path)
    assert torch.equal(tensors.fp32("blk.0.ffn_down.weight"), torch.from_numpy(expected))
    plan = plan_weights(tensors, "auto")
    assert [info.name for info in plan.dequantized] == ["blk.0.ffn_down.weight"]
    with caplog.at_level(logging.WARNING, logger="ifb.builder.weight_loader"):
        warn_dequantized(plan, 4)
    (message,) = _loader_warnings(caplog)
    assert "blk.0.ffn_down.weight (Q8_K)" in message


def test_q8_1_is_refused_naming_why(llama_gguf: Path, tmp_path: Path) -> None:
    """Q8_1: the installed gguf-py reads 40-byte blocks where ggml writes 36; refused (a traceback
    before), not misread."""
    qtype = gguf.GGMLQuantizationType.Q8_1
    blocks = np.zeros((64, 256 // 32 * gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8)
    path = rewrite(llama_gguf, tmp_path / "q8_1.gguf", tensors={"blk.0.ffn_down.weight": (blocks, qtype)})
    with pytest.raises(SourceError, match=r"Q8_1: blk\.0\.ffn_down\.weight \(gguf-py sizes its blocks as 40"):
        _tensors(path)


def test_a_type_nothing_reads_is_refused_naming_it(llama_gguf: Path, tmp_path: Path) -> None:
    ints = np.zeros((64, 256), np.int32)
    path = rewrite(llama_gguf, tmp_path / "i32.gguf", tensors={"blk.0.ffn_down.weight": (ints, None)})
    with pytest.raises(SourceError, match=r"I32: blk\.0\.ffn_down\.weight"):
        _tensors(path)


def test_sixteen_bit_tensors_in_a_block_file_are_named_with_their_cost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An F16 matrix in a Q8_0 file is stored in the engine's fp32 (no 16-bit kernel): one warning
    names it and what widening costs (bytes in the file -> in the engine)."""
    write_hf_checkpoint(tmp_path / "hf", "llama", **OVERRIDES)
    path = write_gguf(tmp_path / "q8.gguf", tmp_path / "hf", linear_type="Q8_0", tensor_types={"ffn_down": "F16"})
    plan = plan_weights(_tensors(path), "auto")
    assert plan.has_blocks
    with caplog.at_level(logging.WARNING, logger="ifb.builder.weight_loader"):
        warn_dequantized(plan, 4)
    (message,) = _loader_warnings(caplog)
    assert "blk.0.ffn_down.weight (F16, 64x256)" in message and "blk.1.ffn_down.weight (F16, 64x256)" in message
    assert "0.07 MB in the file -> 0.13 MB in the engine" in message  # 2 x 64 x 256 x 2 bytes -> x 4 bytes


def test_bias_tensors_follow_the_config(llama_gguf: Path, tmp_path: Path) -> None:
    """A Llama file with q/k/v/o and gate/up/down bias tensors reads as attention_bias and
    mlp_bias (o_proj's and the MLP's stored too); with only some of a group, refused by name."""
    rows = {"attn_q": 64, "attn_k": 32, "attn_v": 32, "attn_output": 64, "ffn_gate": 256, "ffn_up": 256, "ffn_down": 64}
    biases = {f"blk.{i}.{name}.bias": (np.ones(n, np.float32), None) for i in range(2) for name, n in rows.items()}
    path = rewrite(llama_gguf, tmp_path / "bias.gguf", tensors=biases)
    tensors = _tensors(path)
    spec = tensors.spec
    assert (spec.attention_bias, spec.attention_out_bias, spec.mlp_bias) == (True, True, True)
    assert tensors.dense["layers.1.attn.o_proj.bias"] == ("blk.1.attn_output.bias",)
    assert tensors.dense["layers.1.mlp.gate_up.bias"] == ("blk.1.ffn_gate.bias", "blk.1.ffn_up.bias")
    assert tensors.dense["layers.1.mlp.down.bias"] == ("blk.1.ffn_down.bias",)
    partial = rewrite(path, tmp_path / "partial.gguf", drop=("blk.0.attn_output.bias",))
    with pytest.raises(UnsupportedModelError, match="bias tensors for attn_q, attn_k, attn_v but not for attn_output"):
        gguf_config(partial)


def test_hf_biases_follow_attention_bias_and_mlp_bias() -> None:
    """transformers' Llama gives o_proj a bias with attention_bias and gate/up/down with mlp_bias;
    Qwen2's o_proj never has one; Mistral's and Phi-3's layers none."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    def spec(config: Any) -> tuple[bool, bool, bool]:
        s = model_spec_from_hf_config(config)
        return s.attention_bias, s.attention_out_bias, s.mlp_bias

    small: dict[str, Any] = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=64)
    assert spec(LlamaConfig(**small, attention_bias=True, mlp_bias=True)) == (True, True, True)
    assert spec(LlamaConfig(**small, attention_bias=False, mlp_bias=True)) == (False, False, True)
    assert spec(Qwen2Config(**small)) == (True, False, False)
    assert spec(MistralConfig(**small, attention_bias=True)) == (False, False, False)


def test_plain_rope_honours_the_partial_rotary_factor() -> None:
    """Phi-3 with partial_rotary_factor 0.75 and rope_type default rotates 12 of 16 dims (6 pairs),
    as Phi3RotaryEmbedding; Llama's class has no such factor."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": 0.75},
    )
    inv_freq, _ = rope_tables(config, 256)
    assert inv_freq.shape == (6,) and torch.equal(inv_freq, Phi3RotaryEmbedding(config).inv_freq)


def _loader_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The weight loader's own warnings: caplog holds every logger's records of the test, and
    how many others warn depends on the logging set up by tests that ran before (4 in a full run)."""
    return [r.getMessage() for r in caplog.records if r.name == "ifb.builder.weight_loader"]
