"""Tiny seeded HF checkpoints with attention far from uniform, in files llama.cpp's converter reads.

tests/tiny_models.py draws every weight, norms included, from N(0, 0.08): scores are ~0, attention
is uniform, and a network without RoPE or a norm gives the same tokens. Here the weights have a
trained-like scale instead (per family, `sharpen`):

- q/k projections N(0, 0.25) on a 64-wide model: each q/k component has std ~2, so the
  pre-softmax logits have std ~4 (q/k-normed families: norm weights near 2, the same std);
- every norm weight near 1 but not 1 (N(1, 0.2); Gemma stores 1 + w, so w ~ N(0, 0.2));
- embeddings and head scaled so the last logits spread by several units, biases O(1).

Those scales are for a 64-wide model; a wider one (bench/conformance.py's 256, for K-quant rows)
gets the q/k, head and Gemma embedding stds times sqrt(64 / hidden), so the spreads stay the same.

`attention_profile` measures what this buys (mean top attention probability per layer).

The tokenizer is a SentencePiece BPE model (`tokenizer.model`) trained in-process: every
family's converter reads one (Gemma 2's and Phi-3's read nothing else) and no BPE pre-tokenizer
hash check applies, as it does to a `tokenizer.json` (an unknown `chkhsh` is refused).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch
from tiny_models import CORPUS, tiny_config

VOCAB_SIZE = 512
QK_STD = 0.25  # q/k rows on a 64-wide input: components ~2, logits ~4 after the 1/sqrt(d) scale
QK_NORM_MEAN = 2.0  # per-head q/k RMSNorm weights (Qwen3, Gemma 3): the same ~4 logit std
NORM_STD = 0.2
REFERENCE_WIDTH = 64  # the hidden size the stds above are set for


def spm_corpus() -> list[str]:
    """Sentences with enough distinct words for VOCAB_SIZE pieces (deterministic)."""
    words = sorted({word for line in CORPUS for word in line.split()})
    extra = [f"{a}{b}" for a in ("ka", "lo", "mi", "tu", "re", "sa", "no", "ve") for b in ("p", "nd", "st", "rk", "ll")]
    vocab = words + extra
    return [" ".join(vocab[(i * 7 + j * 3) % len(vocab)] for j in range(12)) for i in range(400)] + CORPUS


def write_spm_tokenizer(folder: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """tokenizer.model (a byte-fallback BPE, ids 0/1/2 = <unk>/<s>/</s> as Llama's) and a
    tokenizer_config.json naming its class and special tokens."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(spm_corpus()),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    config = {
        "tokenizer_class": "LlamaTokenizer",  # Phi-3's converter reads this key
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _gemma(config: Any) -> bool:
    return config.model_type in ("gemma2", "gemma3_text")


def sharpen(model: torch.nn.Module, config: Any, generator: torch.Generator) -> None:
    """Trained-like scales on every parameter of `model` (see the module docstring)."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_rows = config.num_attention_heads * head_dim
    kv_rows = config.num_key_value_heads * head_dim
    norm_offset = 0.0 if _gemma(config) else 1.0
    width = (REFERENCE_WIDTH / hidden) ** 0.5  # exactly 1.0 at 64: the tests' weights are unchanged
    # Gemma multiplies embeddings by sqrt(hidden) (x8 here): at 0.25 the embedding outweighed the
    # layers and greedy output repeated the last prompt token whatever RoPE said
    embed_std = 0.05 * width if _gemma(config) else 0.5

    def normal(shape: torch.Size, std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(shape, generator=generator)

    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = param.shape
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                value = normal(shape, NORM_STD, QK_NORM_MEAN - (1.0 - norm_offset))
            elif name.endswith("norm.weight"):
                value = normal(shape, NORM_STD, norm_offset)
            elif name.endswith("embed_tokens.weight"):
                value = normal(shape, embed_std)
            elif name.endswith("lm_head.weight"):
                value = normal(shape, 0.5 * width)  # logits std ~4 on a unit-rms input
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                value = normal(shape, QK_STD * width)
            elif name.endswith("qkv_proj.weight"):  # Phi-3: q and k rows sharp, v rows plain
                value = torch.cat(
                    [normal((q_rows + kv_rows, shape[1]), QK_STD * width), normal((kv_rows, shape[1]), hidden**-0.5)]
                )
            elif name.endswith(".bias"):
                value = normal(shape, 0.5)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                value = normal(shape, shape[1] ** -0.5)
            else:  # v, gate, up: unit-scale outputs
                value = normal(shape, hidden**-0.5)
            param.copy_(value)


def write_sharp_checkpoint(folder: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """A seeded `family` (tiny_models.tiny_config's names) with trained-like weights, saved as
    config.json + model.safetensors + tokenizer.model, at VOCAB_SIZE."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, VOCAB_SIZE, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sharpen(model, config, torch.Generator().manual_seed(seed))
    model.save_pretrained(folder)
    write_spm_tokenizer(folder)
    return folder


def attention_profile(model: torch.nn.Module, token_ids: list[int]) -> list[float]:
    """Per layer, the mean over heads and query positions >= 8 of the largest attention weight
    (1/len for uniform attention; near 1 when each query picks out one key)."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = "eager"  # only eager attention returns its weights
    try:
        with torch.no_grad():
            out = model(torch.tensor([token_ids]), output_attentions=True)
    finally:
        model.config._attn_implementation = previous
    return [float(layer[0, :, 8:].amax(-1).mean()) for layer in out.attentions]
