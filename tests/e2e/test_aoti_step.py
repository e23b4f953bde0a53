"""AotiStep runs the compiled package through AOTInductor's C interface with the GIL released.

That the GIL is free during the call is ctypes' contract for CDLL functions; what it buys is
measured in bench/serving.py (HTTP TTFT p50 at 4 req/s: 1.9 s before, 0.9 s after).
"""

from __future__ import annotations

from pathlib import Path

import torch
from step_cases import run_mixed_step

from ifb.runtime.step.aoti_step import AotiStep
from ifb.runtime.step.backend import NetworkStep
from ifb.runtime.step.engine import Engine


def test_equals_torchs_own_loader_bit_for_bit(tiny_llama_engine: Path) -> None:
    ours = Engine.load(tiny_llama_engine)
    assert isinstance(ours.backend, AotiStep)
    theirs = Engine.load(tiny_llama_engine)
    runner = torch._inductor.aoti_load_package(str(theirs.config.step_package_path))
    theirs.backend = NetworkStep(runner)  # torch's loader, called like our network
    assert torch.equal(run_mixed_step(ours), run_mixed_step(theirs))
    assert torch.equal(ours.kv_cache, theirs.kv_cache)
