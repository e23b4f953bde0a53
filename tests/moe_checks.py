"""What the mixture-of-experts family tests (tests/e2e/test_moe_*.py) share: a tiny seeded model
from transformers' classes with trained-like scales and a decisive router, llama.cpp's converter's
F32 and Q8_0 files of it, compiled engines built once per module, transformers rounded as a Q8_0
file holds its weights, and the routing decisions of both sides.

The converter runs as tests/llama_cpp_converter.py runs it, with one change: it knows no tiny
tokenizer's pre-tokenizer hash, so the hash check answers "default" (what tests/tiny_models.py's
GGUFs say); tensors and keys are the converter's own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from greedy_loop import scattered_blocks
from llama_cpp_converter import _DRIVER as CONVERTER_DRIVER
from llama_cpp_converter import converter_tree
from sharp_models import sharpen, write_spm_tokenizer
from tiny_models import TINY_LIMITS, tiny_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from ifb.builder import build as builder_build
from ifb.builder.build import BuildOptions, build_engine
from ifb.runtime.step.backend import NetworkStep, StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.moe_block import MoeBlock
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

# name -> (source: the HF folder or llama.cpp's file of it, --weights): every engine fp32 compute
ENGINES = {"dense-fp32": ("hf", "auto"), "gguf-f32": ("f32", "auto"), "gguf-q8_0": ("q8_0", "auto")}
ROUTER_SHARPNESS = 2.0  # router logits std ~2: decisive, few near-ties
TIE_GAP = 1e-3  # a token's k-th and (k+1)-th router logits closer than this: a tie, not compared

_DEFAULT_PRE_TOKENIZER = (
    "import convert_hf_to_gguf\n"
    "from conversion.base import TextModel\n"
    "TextModel.get_vocab_base_pre = lambda self, tokenizer: 'default'\n"
)


def write_moe_folder(path: Path, config: Any) -> Path:
    """transformers' model of `config`, seeded, sharpened (tests/sharp_models.py), the router
    ROUTER_SHARPNESS x sharper, saved with a SentencePiece tokenizer."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sharpen(model, config, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(ROUTER_SHARPNESS)
    model.save_pretrained(path)
    write_spm_tokenizer(path)
    return path


def converted_sources(folder: Path) -> dict[str, Path]:
    """The HF folder, and llama.cpp's F32 and Q8_0 files of its weights (converted from a copy
    with tests/tiny_models.py's byte-level BPE tokenizer)."""
    bpe = folder.parent / "hf-bpe"
    bpe.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(folder / name, bpe / name)
    tiny_tokenizer().save_pretrained(bpe)
    files = {outtype: folder.parent / f"{outtype}.gguf" for outtype in ("f32", "q8_0")}
    tree = converter_tree()
    driver = CONVERTER_DRIVER.replace("import convert_hf_to_gguf\n", _DEFAULT_PRE_TOKENIZER)
    argv = [[str(bpe), "--outfile", str(out), "--outtype", outtype] for outtype, out in files.items()]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(tree / "gguf-py"), str(tree)])}
    env.pop("NO_LOCAL_GGUF", None)
    command = [sys.executable, "-c", driver, str(tree), json.dumps(argv)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree, timeout=900)
    assert done.returncode == 0 and all(out.is_file() for out in files.values()), done.stderr[-4000:]
    return {"hf": folder, **files}


def engine_builder(sources: dict[str, Path], root: Path) -> tuple[Callable[[str], Engine], dict[str, Engine]]:
    """`get(name)`: the compiled engine ENGINES[name] describes, built on first use."""
    built: dict[str, Engine] = {}

    def get(name: str) -> Engine:
        if name not in built:
            source, weights = ENGINES[name]
            options = BuildOptions(dtype="fp32", weights=weights, compute="fp32", **TINY_LIMITS)
            with pytest.MonkeyPatch.context() as patch:  # the step cost calibration is not under test
                patch.setattr(builder_build, "calibrate_engine_folder", lambda folder, build_info, **_: None)
                build_engine(sources[source], root / name, options)
            built[name] = Engine.load(root / name, StepMode.COMPILED)
        return built[name]

    return get, built


def oracle(folder: Path, **overrides: Any) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(folder)
    for key, value in overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()


def reference(name: str, folder: Path) -> torch.nn.Module:
    """transformers on the HF folder; for the Q8_0 file, every weight the file holds as Q8_0
    (attention, head, embedding, experts; not the router, nor the norms) rounded through Q8_0
    along its rows as gguf-py rounds them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    hf = oracle(folder)
    if name != "gguf-q8_0":
        return hf
    q8 = GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for param_name, param in hf.named_parameters():
            if param.ndim < 2 or param_name.endswith("mlp.gate.weight"):
                continue
            rows = param.numpy().astype(np.float32).reshape(-1, param.shape[-1])
            param.copy_(torch.from_numpy(dequantize(quantize(rows, q8), q8).reshape(param.shape)))
    return hf


def engine_last_logits(engine: Engine, token_ids: list[int]) -> torch.Tensor:
    table = scattered_blocks(engine, len(token_ids))
    inputs = build_step_inputs([RequestSlice(token_ids, 0, table, sample=True)], engine.config.limits.block_size)
    return engine.step(inputs)[0]


def hf_last_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1]


def logit_error(engine: Engine, hf: torch.nn.Module, text: list[int]) -> float:
    """max |engine - transformers| of the last logits, x their std."""
    theirs = hf_last_logits(hf, text)
    return (engine_last_logits(engine, text) - theirs).abs().max().item() / theirs.std().item()


def eager_moe_engine(engine: Engine) -> tuple[Engine, list[MoeBlock]]:
    """The compiled engine's own network run eagerly, and its layers' MoE blocks."""
    eager = Engine.load(engine.config.folder, StepMode.EAGER)
    assert isinstance(eager.backend, NetworkStep)
    blocks = [layer.mlp for layer in eager.backend.network.layers]
    assert all(isinstance(block, MoeBlock) for block in blocks)
    return eager, blocks  # type: ignore[return-value]


def top_k_sets(logits: torch.Tensor, k: int) -> tuple[list[frozenset[int]], int]:
    """Each token's k highest-scoring experts, and how many tokens have a tie at the k-th place
    (a gap under TIE_GAP between the k-th and the (k+1)-th logit)."""
    ordered = logits.float().sort(dim=-1, descending=True)
    gaps = ordered.values[:, k - 1] - ordered.values[:, k]
    sets = [frozenset(int(e) for e in row[:k]) for row in ordered.indices]
    return sets, int((gaps < TIE_GAP).sum())


def routing(eager: Engine, blocks: list[MoeBlock], hf: torch.nn.Module, text: list[int]) -> list[tuple[Any, Any]]:
    """Per layer: (the engine's top-k sets, transformers') over the prompt's tokens, after checking
    that no token ties on either side. The engine's router logits are taken by a hook on each
    block's router; transformers' from output_router_logits."""
    captured: list[torch.Tensor] = []
    hooks = [block.router.register_forward_hook(lambda _m, _i, out: captured.append(out)) for block in blocks]
    try:
        engine_last_logits(eager, text)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        theirs = hf(torch.tensor([text]), output_router_logits=True).router_logits
    assert len(captured) == len(theirs) == len(blocks)
    pairs = []
    for ours_logits, their_logits, block in zip(captured, theirs, blocks, strict=True):
        ours, our_ties = top_k_sets(ours_logits, block.top_k)
        their_sets, their_ties = top_k_sets(their_logits.reshape(len(text), -1), block.top_k)
        assert (our_ties, their_ties) == (0, 0), "a tie at the k-th expert: choose another seed or prompt"
        pairs.append((ours, their_sets))
    return pairs
