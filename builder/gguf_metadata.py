"""What a GGUF's metadata says that changes the math, read into the HF config or refused by name.

transformers' GGUF reader maps the shapes (`context_length`, `block_count`, head counts, ...) and
drops the rest; llama.cpp's graph reads more. So every `{arch}.*` key is accounted for here:
read (RoPE scaling, biases declared by their tensors), known not to change the computation, or,
where it would change it and we do not apply it, refused with the key's name and value. Keys of
no known meaning outside those namespaces are named in one warning.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.gguf_fields import GgufHeader

logger = logging.getLogger(__name__)

# Read by transformers' GGUF reader, the families or here: the model's shapes and constants
# (a family's own keys are its `gguf_keys`, builder/families/)
UNDERSTOOD_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "vocab_size",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "attention.sliding_window",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.finetuned",  # a flag for the reader, no effect on llama.cpp's graph
    "rope.scaling.attn_factor",
    "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    "rope.scaling.yarn_ext_factor",
    "rope.scaling.yarn_log_multiplier",
    "rope.scale_linear",  # the old name of rope.scaling.factor
)
# Key prefixes whose unread keys would change the computation: refused rather than dropped
MATH_PREFIXES = ("attention.", "rope.", "expert", "ssm.", "wkv.", "moe", "nextn", "shortconv.", "posnet.", "convnext.")
MATH_KEYS = (
    "logit_scale",
    "residual_scale",
    "embedding_scale",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "use_parallel_residual",
    "swin_norm",
    "rescale_every_n_layers",
    "leading_dense_block_count",
    "interleave_moe_layer_step",
    "tensor_data_layout",
    "full_attention_interval",
)
# Keys that may sit at a value meaning "off": refused only when they say otherwise
_OFF_VALUES: dict[str, Any] = {
    "expert_count": 0,
    "expert_used_count": 0,
    "expert_shared_count": 0,
    "attention.causal": True,
    "attention.max_alibi_bias": 0.0,
    "attention.clamp_kqv": 0.0,
    "use_parallel_residual": False,
    "logit_scale": 1.0,
    "residual_scale": 1.0,
    "embedding_scale": 1.0,
}
# tensor name fragments of a mixture of experts: the router and the stacked experts
_EXPERT_TENSOR_MARKS = ("ffn_gate_inp", "_exps", "_shexp", "_chexps")
_SHARED_EXPERT_TENSOR_MARKS = ("_shexp", "_chexps")
# llama.cpp's RoPE factors: one per rotary pair, the inverse frequencies divided by them
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def field_value(reader: Any, key: str) -> Any:
    """A metadata value as Python (str, number, bool or list), None when absent; `reader` a GgufHeader
    (builder/gguf_fields.py) or gguf's GGUFReader."""
    if isinstance(reader, GgufHeader):
        value = reader.fields.get(key)
        return value.tolist() if isinstance(value, np.ndarray) else value
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def refuse_unread_keys(reader: Any, architecture: str, family_keys: tuple[str, ...]) -> None:
    """Refuse, by name, each `{arch}.*` key that changes llama.cpp's computation and that the
    builder does not apply (a mixture of experts first, named as one); warn once of the others.
    `family_keys`: the keys the architecture's family reads besides every family's."""
    prefix = f"{architecture}."
    understood = set(UNDERSTOOD_KEYS) | set(family_keys)
    _refuse_experts(reader, architecture, family_keys)
    refused, unread = [], []
    for key in reader.fields:
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        value = field_value(reader, key)
        if name in understood or (name in _OFF_VALUES and value == _OFF_VALUES[name]):
            continue
        if name.startswith(MATH_PREFIXES) or name in MATH_KEYS or name in _OFF_VALUES:
            refused.append(f"{key} = {value!r}")
        else:
            unread.append(key)
    if refused:
        raise UnsupportedModelError(
            f"GGUF metadata the {architecture} network does not apply (it changes the computation): "
            + "; ".join(refused)
        )
    if unread:
        logger.warning("GGUF metadata not read (not known to change the computation): %s", ", ".join(unread))


def _refuse_experts(reader: Any, architecture: str, family_keys: tuple[str, ...]) -> None:
    """Refuse a mixture of experts, naming it as one, unless its family reads experts (qwen3moe,
    olmoe, Mixtral-style llama); shared experts (`*_shexp`, `*_chexps`: Qwen2-MoE, DeepSeek) are
    refused even then."""
    reads_experts = "expert_count" in family_keys
    counts = {
        key: field_value(reader, f"{architecture}.{key}")
        for key in ("expert_count", "expert_used_count")
        if field_value(reader, f"{architecture}.{key}") and not reads_experts
    }
    marks = _SHARED_EXPERT_TENSOR_MARKS if reads_experts else _EXPERT_TENSOR_MARKS
    tensors = [t.name for t in reader.tensors if any(mark in t.name for mark in marks)]
    if reads_experts and tensors:
        raise UnsupportedModelError(
            f"this {architecture} GGUF has shared experts ({', '.join(tensors[:4])}); only routed experts are supported"
        )
    if counts or tensors:
        said = ", ".join(f"{architecture}.{key} = {value}" for key, value in counts.items())
        shown = ", ".join(tensors[:4]) + (f" (+{len(tensors) - 4} more)" if len(tensors) > 4 else "")
        raise UnsupportedModelError(
            f"this {architecture} GGUF is a mixture of experts ({'; '.join(p for p in (said, shown) if p)}); "
            "only dense models and the expert families' files (qwen3moe, olmoe, llama with experts) are supported"
        )


def rope_scaling_parameters(reader: Any, architecture: str, also: tuple[str, ...] = ()) -> dict[str, Any]:
    """The file's `rope.scaling.*` keys as transformers' `rope_parameters` entries (empty: plain
    RoPE). llama.cpp applies a factor without a type (or the old `rope.scale_linear`) as linear;
    YaRN's keys are the converter's copies of the checkpoint's `rope_parameters`, so transformers'
    YaRN on them is the HF folder's. `also`: the types the caller's family reads itself (Phi-3's
    longrope, from tensors), returned empty; anything else is refused by name."""
    prefix = f"{architecture}.rope."
    kind = field_value(reader, prefix + "scaling.type")
    factor = field_value(reader, prefix + "scaling.factor")
    if factor is None:
        factor = field_value(reader, prefix + "scale_linear")
    if kind in also:
        return {}
    if kind in (None, "none", "linear"):
        if factor is None or float(factor) in (0.0, 1.0):
            return {}
        return {"rope_type": "linear", "factor": float(factor)}
    if kind != "yarn":
        raise UnsupportedModelError(
            f"GGUF {prefix}scaling.type {kind!r} is not supported on {architecture}; supported: "
            + ", ".join(("none", "linear", "yarn", *also))
        )
    return _yarn_parameters(reader, prefix, factor)


def _yarn_parameters(reader: Any, prefix: str, factor: Any) -> dict[str, Any]:
    original = field_value(reader, prefix + "scaling.original_context_length")
    if factor is None or original is None:
        raise UnsupportedModelError(
            f"GGUF {prefix}scaling.type 'yarn' needs {prefix}scaling.factor and "
            f"{prefix}scaling.original_context_length; got factor={factor}, original_context_length={original}"
        )
    ext_factor = field_value(reader, prefix + "scaling.yarn_ext_factor")
    if ext_factor is not None and not math.isclose(float(ext_factor), 1.0):
        raise UnsupportedModelError(
            f"GGUF {prefix}scaling.yarn_ext_factor = {ext_factor} is not supported (transformers' YaRN: 1.0)"
        )
    log_multiplier = field_value(reader, prefix + "scaling.yarn_log_multiplier")
    if log_multiplier:
        raise UnsupportedModelError(
            f"GGUF {prefix}scaling.yarn_log_multiplier = {log_multiplier} is not supported (DeepSeek's YaRN)"
        )
    params: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
    }
    optional = {"attention_factor": "attn_factor", "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow"}
    for ours, theirs in optional.items():
        value = field_value(reader, prefix + "scaling." + theirs)
        if value is not None:
            params[ours] = float(value)
    return params


def rope_freq_factors(reader: Any, architecture: str, applied: bool) -> tuple[float, ...] | None:
    """llama.cpp's `rope_freqs.weight` (its converter's form of Llama 3's `llama3` scaling, with
    no metadata key): one factor per rotary pair, each inverse frequency divided by its factor.
    Refused unless `applied` (families whose llama.cpp graph we know to apply it)."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if tensor is None:
        return None
    if not applied:
        raise UnsupportedModelError(f"GGUF tensor {ROPE_FREQS_TENSOR} is not supported on {architecture}")
    if tensor.tensor_type.name != "F32":
        raise UnsupportedModelError(f"GGUF tensor {ROPE_FREQS_TENSOR} is {tensor.tensor_type.name}; expected F32")
    return tuple(float(x) for x in tensor.data)


def declared_biases(reader: Any, with_mlp: bool) -> dict[str, bool]:
    """`attention_bias` (and, `with_mlp`, `mlp_bias`) as the file's tensors declare them
    (llama.cpp applies a bias wherever its tensor exists): Llama's attention_bias gives q, k, v and
    o a bias, mlp_bias gate, up and down. A file with some of a group but not all is refused by
    name; bias tensors the config cannot declare are left to the tensor accounting to refuse."""
    names = {t.name for t in reader.tensors}
    groups: dict[str, tuple[str, ...]] = {"attention_bias": ("attn_q", "attn_k", "attn_v", "attn_output")}
    if with_mlp:
        groups["mlp_bias"] = ("ffn_gate", "ffn_up", "ffn_down")
    declared: dict[str, bool] = {}
    for field, parts in groups.items():
        present = [part for part in parts if f"blk.0.{part}.bias" in names]
        if present and len(present) != len(parts):
            raise UnsupportedModelError(
                f"GGUF has bias tensors for {', '.join(present)} but not for "
                f"{', '.join(p for p in parts if p not in present)}: {field} covers all of them"
            )
        declared[field] = bool(present)
    return declared
