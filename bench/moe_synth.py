"""Full-size mixture-of-experts GGUFs of random valid blocks, written directly (no F16 intermediate).

    .venv/bin/python bench/moe_synth.py --model qwen3moe-30b-a3b-q4km [--layers 48] [--out FILE]
    .venv/bin/python bench/moe_synth.py --model gpt-oss-20b-mxfp4 [--layers 24] [--out FILE]

Issue #37's memory rows need the real sizes: a Qwen3-30B-A3B-shaped Q4_K_M file (~18 GB) and a
gpt-oss-20b-shaped MXFP4 one (~12 GB). Quantizing from F16 would need a 61 GB intermediate, so each
tensor is written as random *valid* blocks of the type llama.cpp's quantizer would give it: random
bytes with each block's scales set in the range N(0, 0.02) weights quantize to (tests/tiny_models.py's
RANDOM_BLOCK_TYPES, plus Q8_0 and MXFP4 here). Writing is streamed: the header and tensor infos
first, then each tensor cut at random block offsets from one pool of valid blocks per type (fresh
random bytes for 30 GB would cost minutes of CPU; the benchmarks need only realistic sizes and
value ranges), so a file of any size takes a few hundred MB of RAM.

Types, as `llama-quantize ... Q4_K_M` assigns them (llama.cpp's llama_tensor_get_type): q/k/o and
gate/up experts Q4_K; v and down experts Q6_K on the "more bits" layers (the first and last eighth
and every third between), Q4_K elsewhere; token embedding Q4_K, untied output Q6_K; norms and the
router F32. gpt-oss's file holds the experts in MXFP4 (as the released checkpoints do and llama.cpp's
converter keeps them) and, here, the other matrices in Q8_0, biases and sinks F32.

Each file carries a synthetic byte-level BPE vocabulary of the real size (tests/gguf_vocab.py), so
the embedding and head have their real bytes; prompts in the peer benchmarks are sized with it.
`--layers` below the real depth gives the reduced-depth files of the speed rows (stated as such).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

POOL_BLOCKS = 1 << 20  # valid blocks per type in the pool (144-210 MB for the K-quants)
CHUNK_BLOCKS = 1 << 18  # blocks per write


@dataclass(frozen=True, slots=True)
class MoeShape:
    """The dimensions and GGUF metadata of one released mixture of experts."""

    name: str
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    expert_ffn: int
    dense_ffn: int  # the config's intermediate_size, written as feed_forward_length
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    expert_type: str  # gate/up/down experts where no "more bits" rule applies
    matrix_type: str  # attention and embedding matrices likewise
    output_type: str
    k_quant_mix: bool  # Q4_K_M's rule: v and down experts Q6_K on the "more bits" layers
    gpt_oss: bool = False  # biases, sinks, post-attention norm name, sliding window, YaRN


QWEN3MOE_30B_A3B = MoeShape(
    name="Qwen3-30B-A3B-shaped (random valid blocks)", arch="qwen3moe", hidden=2048, layers=48, heads=32,
    kv_heads=4, head_dim=128, experts=128, experts_used=8, expert_ffn=768, dense_ffn=6144, vocab=151936,
    context=40960, rope_theta=1_000_000.0, rms_eps=1e-6, expert_type="Q4_K", matrix_type="Q4_K",
    output_type="Q6_K", k_quant_mix=True,
)  # fmt: skip
GPT_OSS_20B = MoeShape(
    name="gpt-oss-20b-shaped (random valid blocks)", arch="gpt-oss", hidden=2880, layers=24, heads=64,
    kv_heads=8, head_dim=64, experts=32, experts_used=4, expert_ffn=2880, dense_ffn=2880, vocab=201088,
    context=131072, rope_theta=150000.0, rms_eps=1e-5, expert_type="MXFP4", matrix_type="Q8_0",
    output_type="Q8_0", k_quant_mix=False, gpt_oss=True,
)  # fmt: skip
SHAPES = {"qwen3moe-30b-a3b-q4km": QWEN3MOE_30B_A3B, "gpt-oss-20b-mxfp4": GPT_OSS_20B}
GPT_OSS_WINDOW, GPT_OSS_YARN_FACTOR, GPT_OSS_YARN_ORIGINAL = 128, 32.0, 4096


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K for v and down."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """One tensor of the file: its GGUF name, shape (rows last-dim-first as numpy), type."""

    name: str
    shape: tuple[int, ...]  # numpy order: ([experts,] rows, cols) or (n,)
    type_name: str  # "F32" or a block type


def tensor_plan(shape: MoeShape, layers: int) -> list[TensorPlan]:
    """Every tensor in convert_hf_to_gguf's order for `layers` of `shape`."""
    h, q, kv, e, f = (
        shape.hidden,
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
        shape.experts,
        shape.expert_ffn,
    )
    plan = [TensorPlan("token_embd.weight", (shape.vocab, h), shape.matrix_type)]
    for i in range(layers):
        rich = shape.k_quant_mix and more_bits(i, layers)
        v_type = "Q6_K" if rich else shape.matrix_type
        down_type = "Q6_K" if rich else shape.expert_type
        blk = f"blk.{i}"
        plan += [
            TensorPlan(f"{blk}.attn_norm.weight", (h,), "F32"),
            TensorPlan(f"{blk}.attn_q.weight", (q, h), shape.matrix_type),
            TensorPlan(f"{blk}.attn_k.weight", (kv, h), shape.matrix_type),
            TensorPlan(f"{blk}.attn_v.weight", (kv, h), v_type),
            TensorPlan(f"{blk}.attn_output.weight", (h, q), shape.matrix_type),
        ]
        if shape.gpt_oss:
            plan += [
                TensorPlan(f"{blk}.attn_q.bias", (q,), "F32"),
                TensorPlan(f"{blk}.attn_k.bias", (kv,), "F32"),
                TensorPlan(f"{blk}.attn_v.bias", (kv,), "F32"),
                TensorPlan(f"{blk}.attn_output.bias", (h,), "F32"),
                TensorPlan(f"{blk}.attn_sinks.weight", (shape.heads,), "F32"),
                TensorPlan(f"{blk}.post_attention_norm.weight", (h,), "F32"),
                TensorPlan(f"{blk}.ffn_gate_inp.bias", (e,), "F32"),
                TensorPlan(f"{blk}.ffn_gate_exps.bias", (e, f), "F32"),
                TensorPlan(f"{blk}.ffn_up_exps.bias", (e, f), "F32"),
                TensorPlan(f"{blk}.ffn_down_exps.bias", (e, h), "F32"),
            ]
        else:
            plan += [
                TensorPlan(f"{blk}.attn_q_norm.weight", (shape.head_dim,), "F32"),
                TensorPlan(f"{blk}.attn_k_norm.weight", (shape.head_dim,), "F32"),
                TensorPlan(f"{blk}.ffn_norm.weight", (h,), "F32"),
            ]
        plan += [
            TensorPlan(f"{blk}.ffn_gate_inp.weight", (e, h), "F32"),
            TensorPlan(f"{blk}.ffn_gate_exps.weight", (e, f, h), shape.expert_type),
            TensorPlan(f"{blk}.ffn_up_exps.weight", (e, f, h), shape.expert_type),
            TensorPlan(f"{blk}.ffn_down_exps.weight", (e, h, f), down_type),
        ]
    plan += [
        TensorPlan("output_norm.weight", (h,), "F32"),
        TensorPlan("output.weight", (shape.vocab, h), shape.output_type),
    ]
    return plan


def block_pool(type_name: str, rng: np.random.Generator) -> np.ndarray:
    """uint8 [POOL_BLOCKS, block bytes] of valid random blocks of `type_name`."""
    import gguf
    from tiny_models import RANDOM_BLOCK_TYPES

    qtype = gguf.GGMLQuantizationType[type_name]
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(POOL_BLOCKS, block_bytes), dtype=np.uint8)
    if type_name == "MXFP4":
        # e8m0 scale 2^(e - 127): 2^-9..2^-6 puts e2m1's 0.5..6 around N(0, 0.02)'s magnitudes
        blocks[:, 0] = rng.integers(118, 122, size=POOL_BLOCKS, dtype=np.uint8)
        return blocks
    offsets, scales = {"Q8_0": ((0,), (1.6e-4,))}.get(type_name) or RANDOM_BLOCK_TYPES[type_name]
    for offset, scale in zip(offsets, scales, strict=True):
        values = (scale * rng.uniform(0.5, 1.5, size=POOL_BLOCKS)).astype(np.float16)
        blocks[:, offset : offset + 2] = values.view(np.uint8).reshape(POOL_BLOCKS, 2)
    return blocks


def tensor_bytes(plan: TensorPlan) -> tuple[tuple[int, ...], int]:
    """(byte shape for add_tensor_info, total bytes) of one tensor."""
    import gguf

    if plan.type_name == "F32":
        return plan.shape, 4 * int(np.prod(plan.shape))
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[plan.type_name]]
    *lead, cols = plan.shape
    if cols % block_weights:
        raise ValueError(f"{plan.name}: {cols} columns are not whole {plan.type_name} blocks of {block_weights}")
    row_bytes = cols // block_weights * block_bytes
    return (*lead, row_bytes), int(np.prod(lead)) * row_bytes


def f32_values(plan: TensorPlan, rng: np.random.Generator) -> np.ndarray:
    """Norms 1.0; routers, biases and sinks small normals (sinks of std 1, as a trained model's)."""
    n = int(np.prod(plan.shape))
    if plan.name.endswith("norm.weight"):
        return np.ones(n, dtype=np.float32)
    std = 1.0 if "sinks" in plan.name else 0.02
    return (rng.standard_normal(n, dtype=np.float32) * std).astype(np.float32)


def block_chunks(pool: np.ndarray, nbytes: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Windows of the pool (at random block offsets) that add up to `nbytes`."""
    block_bytes = pool.shape[1]
    remaining = nbytes // block_bytes
    flat = pool.reshape(-1)
    while remaining:
        count = min(CHUNK_BLOCKS, remaining)
        start = int(rng.integers(0, POOL_BLOCKS - count + 1))
        yield flat[start * block_bytes : (start + count) * block_bytes]
        remaining -= count


def write_moe_gguf(path: Path, shape: MoeShape, layers: int, seed: int = 0) -> dict[str, object]:
    """Stream `layers` of `shape` as a GGUF of random valid blocks to `path` (via path.partial)."""
    import gguf
    from gguf_synth import write_metadata
    from gguf_vocab import synthetic_vocab

    t0 = time.perf_counter()
    vocab = synthetic_vocab(shape.vocab, "gpt2", seed=seed)
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, shape.arch)
    writer.add_type("model")
    writer.add_name(shape.name if layers == shape.layers else f"{shape.name}, {layers} of {shape.layers} layers")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(shape.dense_ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.experts_used)
    writer.add_expert_feed_forward_length(shape.expert_ffn)
    if shape.gpt_oss:
        writer.add_sliding_window(GPT_OSS_WINDOW)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(GPT_OSS_YARN_FACTOR)
        writer.add_rope_scaling_orig_ctx_len(GPT_OSS_YARN_ORIGINAL)
    writer.add_vocab_size(shape.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if shape.arch == "qwen3moe" else "gpt-4o")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges or [])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if shape.k_quant_mix else gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    plan = tensor_plan(shape, layers)
    for item in plan:
        byte_shape, nbytes = tensor_bytes(item)
        if item.type_name == "F32":
            writer.add_tensor_info(item.name, byte_shape, np.dtype(np.float32), nbytes)
        else:
            raw = gguf.GGMLQuantizationType[item.type_name]
            writer.add_tensor_info(item.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=raw)
    fout, align = write_metadata(writer)
    rng = np.random.default_rng(seed)
    pools: dict[str, np.ndarray] = {}
    total = 0
    for item in plan:
        fout.write(b"\0" * (-fout.tell() % align))
        _, nbytes = tensor_bytes(item)
        if item.type_name == "F32":
            f32_values(item, rng).tofile(fout)
        else:
            pool = pools.get(item.type_name)
            if pool is None:
                pool = pools[item.type_name] = block_pool(item.type_name, rng)
            for chunk in block_chunks(pool, nbytes, rng):
                chunk.tofile(fout)
        total += nbytes
    fout.write(b"\0" * (-fout.tell() % align))
    writer.close()
    partial.rename(path)
    return {"tensors": len(plan), "data_bytes": total, "layers": layers, "write_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the real depth)")
    parser.add_argument("--out", type=Path, default=None, help="file (default: bench/out/byo/MODEL[-NL].gguf)")
    args = parser.parse_args()
    shape = SHAPES[args.model]
    layers = args.layers or shape.layers
    suffix = "" if layers == shape.layers else f"-{layers}l"
    out = args.out or ROOT / "bench" / "out" / "byo" / f"{args.model}{suffix}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    info = write_moe_gguf(out, shape, layers)
    print(f"{out}: {out.stat().st_size / 1e9:.2f} GB {info}")


if __name__ == "__main__":
    main()
