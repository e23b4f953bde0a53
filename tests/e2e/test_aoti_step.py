"""AotiStep runs the compiled package through AOTInductor's C interface with the GIL released.

That the GIL is free during the call is ctypes' contract for CDLL functions; what it buys is
measured in bench/serving.py (HTTP TTFT p50 at 4 req/s: 1.9 s before, 0.9 s after).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from step_cases import run_mixed_step

from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.errors import EngineFormatError
from ifb.runtime.step.aoti_step import AotiStep
from ifb.runtime.step.backend import NetworkStep, load_engine_kernels, step_constants
from ifb.runtime.step.engine import Engine


def test_equals_torchs_own_loader_bit_for_bit(tiny_llama_engine: Path) -> None:
    ours = Engine.load(tiny_llama_engine)
    assert isinstance(ours.backend, AotiStep)
    theirs = Engine.load(tiny_llama_engine)
    runner = torch._inductor.aoti_load_package(str(theirs.config.step_package_path))
    theirs.backend = NetworkStep(runner)  # torch's loader, called like our network
    assert torch.equal(run_mixed_step(ours), run_mixed_step(theirs))
    assert torch.equal(ours.kv_cache, theirs.kv_cache)


def test_a_constant_of_another_dtype_than_compiled_is_refused(tiny_q4_gguf_engine: Path) -> None:
    """A package compiled without its weights reads each bound tensor's bytes as the dtype it was
    compiled for; binding another dtype (as a bf16 copy of the fp32 rotary tables once did) is
    refused naming the constant, not run."""
    config = EngineConfig.load(tiny_q4_gguf_engine)
    assert config.step_constants_external
    load_engine_kernels(config)
    constants = step_constants(config)
    AotiStep(config.step_package_path, constants)  # as built: binds
    norm = next(name for name in constants if name.endswith("input_norm.weight"))
    constants[norm] = constants[norm].to(torch.bfloat16)
    with pytest.raises(EngineFormatError, match=f"{norm}.*float32.*bfloat16"):
        AotiStep(config.step_package_path, constants)
