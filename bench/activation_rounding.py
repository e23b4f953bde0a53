"""What rounding activations to int8 adds, per linear layer: ifb's `--compute int8` vs llama.cpp's.

    .venv/bin/python bench/activation_rounding.py HF_FOLDER FILE.gguf [--f32 FILE-f32.gguf] [--prompts 4]

bench/conformance.py's quantized rows compare whole engines. This isolates one part of them: on the
activations transformers (fp32, the HF folder) feeds each linear layer for the conformance prompts,
the relative output error ||(x~ - x) W^T|| / ||x W^T|| of each activation quantizer against exact x,
with W the file's own weights dequantized (so weight rounding is common to both and left out):

- ifb (plugins/csrc/quant_matmul_int8.cpp): per 32 values, d = max|x| / 127 in fp32, q = round half
  to even (x / d);
- llama.cpp (ggml-cpu): for Q8_0/Q4_0/Q5_0/Q4_1/Q5_1 weights, quantize_row_q8_0: per 32, q = roundf(x / d),
  d stored as fp16; for K-quant weights (Q4_K, Q5_K, Q6_K...), quantize_row_q8_K: one scale per 256,
  iscale = -127 / (the signed value of largest magnitude), q = nearest_int(iscale x) clamped to 127.

Both are emulated in float64, so the printed numbers are the quantizers', not any kernel's. With
--f32 (the same checkpoint's F32 file) the weights' own rounding is printed alongside for scale.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests")]

from sharp_models import VOCAB_SIZE  # noqa: E402
from step_cases import prompts as random_prompts  # noqa: E402

# HF module name -> GGUF tensor name (llama.cpp's converter), per block
GGUF_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "qkv_proj": "attn_qkv",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "gate_up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
PER_32_FORMATS = ("Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1")  # llama.cpp pairs these with Q8_0 activations
LENGTHS = (11, 24, 37, 50)  # bench/conformance.py's prompt lengths, cycled


def ifb_int8(x: torch.Tensor) -> torch.Tensor:
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks / torch.where(d == 0, torch.ones_like(d), d))  # torch.round: half to even
    return (q * d).reshape(x.shape)


def llama_q8_0(x: torch.Tensor) -> torch.Tensor:
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.sign(blocks) * torch.floor(blocks.abs() / torch.where(d == 0, torch.ones_like(d), d) + 0.5)  # roundf
    return (q * d.float().half().double()).reshape(x.shape)


def llama_q8_k(x: torch.Tensor) -> torch.Tensor:
    blocks = x.reshape(x.shape[0], -1, 256)
    signed_max = torch.gather(blocks, -1, blocks.abs().argmax(-1, keepdim=True))
    iscale = torch.where(signed_max == 0, torch.zeros_like(signed_max), -127 / signed_max)
    q = torch.clamp(torch.round(iscale * blocks), max=127)
    d = torch.where(iscale == 0, torch.zeros_like(iscale), 1 / iscale)
    return (q * d).reshape(x.shape)


def layer_inputs(folder: Path, n_prompts: int, gguf_names: set[str]) -> dict[str, torch.Tensor]:
    """Every linear layer's input rows over the prompts, keyed by the GGUF tensor it reads."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    captured: dict[str, list[torch.Tensor]] = {}

    def keep(name: str):  # type: ignore[no-untyped-def]
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            captured.setdefault(name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).double())

        return hook

    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        parts = name.split(".")
        if parts[-1] == "lm_head":
            tensor = "output" if "output" in gguf_names else "token_embd"
        else:
            tensor = f"blk.{parts[2]}.{GGUF_NAMES[parts[-1]]}"
        module.register_forward_pre_hook(keep(tensor))
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(n_prompts)]
    with torch.no_grad():
        for prompt in random_prompts(VOCAB_SIZE, lengths, seed=11):  # bench/conformance.py's prompts
            model(torch.tensor([prompt]))
    return {name: torch.cat(rows) for name, rows in captured.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_folder", type=Path)
    parser.add_argument("gguf", type=Path, help="the quantized file (bench/out/conformance/CASE/CASE-q4_k_m.gguf)")
    parser.add_argument("--f32", type=Path, help="the same checkpoint's F32 file: print the weights' own rounding")
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name.removesuffix(".weight"): t for t in GGUFReader(args.gguf).tensors}
    exact = {t.name.removesuffix(".weight"): t for t in GGUFReader(args.f32).tensors} if args.f32 else {}
    ours_all, theirs_all = [], []
    for name, x in layer_inputs(args.hf_folder, args.prompts, set(tensors)).items():
        tensor = tensors[name]
        kind = tensor.tensor_type.name
        w = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).astype(np.float64)).reshape(-1, x.shape[-1])
        y = x @ w.T
        ours = float(((ifb_int8(x) - x) @ w.T).norm() / y.norm())
        per_32 = kind in PER_32_FORMATS
        theirs = float((((llama_q8_0 if per_32 else llama_q8_k)(x) - x) @ w.T).norm() / y.norm())
        apart = float(((ifb_int8(x) - (llama_q8_0 if per_32 else llama_q8_k)(x)) @ w.T).norm() / y.norm())
        line = (
            f"{name:20s} {kind:5s} ifb per-32 {ours:.2e}  llama.cpp {'Q8_0' if per_32 else 'Q8_K'} {theirs:.2e}"
            f"  ratio {theirs / ours:.2f}  the two apart {apart:.1e}"
        )
        if name in exact:
            w0 = torch.from_numpy(np.asarray(exact[name].data, dtype=np.float64)).reshape(w.shape)
            line += f"  weights' own rounding {float((y - x @ w0.T).norm() / (x @ w0.T).norm()):.2e}"
        print(line)
        ours_all.append(ours)
        theirs_all.append(theirs)
    larger = sum(t > o for o, t in zip(ours_all, theirs_all, strict=True))
    print(
        f"median: ifb {statistics.median(ours_all):.2e}, llama.cpp {statistics.median(theirs_all):.2e}; "
        f"llama.cpp's the larger on {larger} of {len(ours_all)} layers"
    )


if __name__ == "__main__":
    main()
