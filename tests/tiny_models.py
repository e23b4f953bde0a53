"""Tiny seeded random checkpoints written as real files: HF folders (Llama, Mistral, Qwen2, Qwen3,
SmolLM3, Phi-3, Gemma 2, Gemma 3) and GGUFs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Qwen3-Thinking style: the prompt opens a think block unless enable_thinking is false.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|assistant|>",
    "<|assistant|>{% if enable_thinking is defined and not enable_thinking %}<think></think>"
    "{% else %}<think>{% endif %}",
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "in flight batching admits requests between steps",
    "paged attention stores keys and values in blocks",
    "hello world, this is a tiny tokenizer for tests 0123456789",
] * 20
SPECIAL = ["<unk>", "<s>", "</s>"]

# The limits every tiny test engine is built with (CPU and TensorRT alike).
TINY_LIMITS = dict(max_batch_size=8, max_num_tokens=64, max_seq_len=256, block_size=16, kv_blocks=48)


def tiny_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE trained in-process on a fixed corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(architecture: str, vocab_size: int, **overrides: Any) -> Any:
    from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config, SmolLM3Config

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if architecture == "llama":
        return LlamaConfig(**common)
    if architecture == "mistral":
        # no window unless asked (MistralConfig's default is 7B v0.1's 4096)
        return MistralConfig(**{"sliding_window": None, **common})
    if architecture == "qwen2":
        return Qwen2Config(**common)
    if architecture == "qwen3":
        # head_dim 32 with 4 heads of a 64-wide model, as Qwen3 (head_dim 128 at hidden 1024):
        # q's width differs from hidden, so head_dim must be read, not derived
        return Qwen3Config(**{"head_dim": 32, **common})
    if architecture == "smollm3":
        # layer 1 without RoPE; no pad id (its default, 128004, is past the tiny vocabulary)
        return SmolLM3Config(**{"no_rope_layers": [1, 0], "pad_token_id": None, **common})
    if architecture == "phi3":
        # no pad id (its default, 32000, is past the tiny vocabulary); no window unless asked
        return Phi3Config(**{"pad_token_id": None, "sliding_window": None, **common})
    if architecture == "gemma3_text":
        from transformers import Gemma3TextConfig

        # tied, as every Gemma 3; head_dim 16 of 4 heads; six layers, llama.cpp's fixed pattern
        # (five local, then one global) unless layer_types says otherwise
        gemma: dict[str, Any] = dict(head_dim=16, num_hidden_layers=6, tie_word_embeddings=True, pad_token_id=0)
        return Gemma3TextConfig(**{**common, **gemma, **overrides})
    if architecture == "gemma2":
        from transformers import Gemma2Config

        # tied, head_dim 16 of 4 heads; four layers, transformers' (and llama.cpp's) pattern:
        # even layers local, odd ones global
        gemma2: dict[str, Any] = dict(head_dim=16, num_hidden_layers=4, tie_word_embeddings=True, pad_token_id=0)
        return Gemma2Config(**{**common, **gemma2, **overrides})
    raise ValueError(architecture)


def write_hf_checkpoint(
    folder: Path, architecture: str = "llama", seed: int = 0, vocab_size: int | None = None, **overrides: Any
) -> Path:
    """A random model as config.json + model.safetensors + tokenizer files (the tiny tokenizer;
    `vocab_size`, default its size, may be larger, as bench/families.py's real-shaped models)."""
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    config = tiny_config(architecture, vocab_size or len(tokenizer), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():  # larger than init's std so logits are well separated
            param.normal_(0, 0.08)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """The Q/K row order llama.cpp's converter writes (transformers' GGUF loader undoes it)."""
    rows = weights.shape[0]
    return (
        weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
    )


# Types gguf-py cannot quantize: written as random *valid* blocks (finite positive fp16 scales at
# these byte offsets, every other byte random), scaled so weights come out with a std near 0.05.
RANDOM_BLOCK_TYPES: dict[str, tuple[tuple[int, ...], tuple[float, ...]]] = {
    "Q4_K": ((0, 2), (3e-4, 2e-3)),
    "Q5_K": ((0, 2), (1.5e-4, 2e-3)),
    "Q6_K": ((208,), (8e-5,)),
    "Q3_K": ((108,), (1e-3,)),
    "Q2_K": ((80, 82), (1e-3, 1e-3)),
}


# Per-kind GGUF types as llama.cpp's Q4_K_M quantizer writes them (q/k/gate/up Q4_K, v Q6_K, the
# tied head/embedding Q6_K), with down as Q5_0, its fallback for rows not a multiple of 256.
Q4_K_M_LIKE = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q4_K",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q5_0",
    "token_embd.weight": "Q6_K",
}


def random_blocks(rows: int, cols: int, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes] of valid random `type_name` blocks (see RANDOM_BLOCK_TYPES)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    num_blocks = rows * cols // block_weights
    blocks = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    offsets, scales = RANDOM_BLOCK_TYPES[type_name]
    for offset, scale in zip(offsets, scales, strict=True):
        values = (scale * rng.uniform(0.5, 1.5, size=num_blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = values.view(np.uint8).reshape(num_blocks, 2)
    return blocks.reshape(rows, cols // block_weights * block_bytes)


def write_gguf(
    path: Path,
    hf_folder: Path,
    linear_type: str | None = None,
    embed_type: str | None = None,
    tensor_types: dict[str, str] | None = None,
    seed: int = 0,
) -> Path:
    """Write the HF checkpoint at `hf_folder` (Llama or Qwen3) as a GGUF with its tokenizer: F32, or with
    the linear layers (and LM head) quantized by gguf-py to `linear_type` (e.g. "Q4_1") and the
    token embedding to `embed_type` (e.g. "Q8_0"), as llama.cpp's converter would write them.
    `tensor_types` overrides per GGUF tensor ("blk.1.attn_v.weight", "token_embd.weight") or per
    kind ("attn_v"); K-quant types are written as random valid blocks (`random_blocks`)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(hf_folder)
    tokenizer = AutoTokenizer.from_pretrained(hf_folder)
    state = load_file(str(hf_folder / "model.safetensors"))
    architecture = config.model_type
    # llama.cpp's converter writes Mistral as arch llama; transformers tells it by its name
    gguf_architecture = {"mistral": "llama", "gemma3_text": "gemma3"}.get(architecture, architecture)
    gemma = gguf_architecture in ("gemma2", "gemma3")
    writer = gguf.GGUFWriter(str(path), gguf_architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    gemma3 = gguf_architecture == "gemma3"
    rope_parameters = config.rope_parameters["full_attention"] if gemma3 else config.rope_parameters
    writer.add_rope_freq_base(float(rope_parameters["rope_theta"]))
    if gemma and rope_parameters.get("rope_type") == "linear":  # as llama.cpp's Gemma 3 converter
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope_parameters["factor"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "sliding_window", None):  # `{arch}.attention.sliding_window`
        writer.add_sliding_window(config.sliding_window)
    if gguf_architecture == "gemma2" and config.attn_logit_softcapping is not None:  # as llama.cpp's converter
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if gguf_architecture == "gemma2" and config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if architecture == "phi3":  # as llama.cpp's Phi-3 converter: rotary dims, LongRoPE factors as tensors
        rope = config.rope_parameters
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if rope.get("rope_type") == "longrope":
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    writer.add_vocab_size(config.vocab_size)
    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = tokenizer.backend_tokenizer.to_str()
    import json

    model_json = json.loads(merges)["model"]
    merge_list = [m if isinstance(m, str) else " ".join(m) for m in model_json["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    writer.add_token_merges(merge_list)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3: fused, as its converter keeps them
        "mlp.gate_up_proj.weight": "ffn_up.weight",
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.bias": "attn_q.bias",  # Qwen2's q/k/v bias
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
    }
    if gemma:  # llama.cpp's Gemma 2/3 names: four norms a layer
        per_layer.update(
            {
                "post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
            }
        )
    permuted = gguf_architecture in ("llama", "smollm3")  # llama.cpp's LlamaModel converters permute q/k rows

    overrides = tensor_types or {}
    rng = np.random.default_rng(seed)

    def add(gguf_name: str, array: np.ndarray, kind: str | None) -> None:
        kind = overrides.get(gguf_name, overrides.get(gguf_name.split(".")[-2], kind))
        if kind is None or array.ndim != 2:
            writer.add_tensor(gguf_name, array)
            return
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in RANDOM_BLOCK_TYPES:
            blocks = random_blocks(array.shape[0], array.shape[1], kind, rng)
        else:
            blocks = gguf.quants.quantize(array, qtype)
        writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)

    for name, tensor in state.items():
        array = tensor.float().numpy()
        if gemma and name.endswith("norm.weight"):  # llama.cpp's Gemma converter stores 1 + w
            array = array + 1
        if name in names:
            add(names[name], array, embed_type if name == "model.embed_tokens.weight" else linear_type)
            continue
        layer = int(name.split(".")[2])
        suffix = name.split(".", 3)[3]
        if permuted and suffix == "self_attn.q_proj.weight":
            array = _llama_cpp_permute(array, config.num_attention_heads)
        elif permuted and suffix == "self_attn.k_proj.weight":
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        add(f"blk.{layer}.{per_layer[suffix]}", array, linear_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
