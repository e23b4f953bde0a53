"""Engine: a loaded engine folder that runs one step per call over the KV pool it owns."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.step.backend import StepBackend, StepMode, make_step_backend
from ifb.runtime.step.input_bounds import check_step_inputs
from ifb.runtime.step.kv_pool import engine_kv_pool
from ifb.runtime.step.step_inputs import StepInputs


def set_compute_threads(threads: int | None) -> None:
    """torch's intra-op threads for this process (`ifb run --threads`, each `ifb serve` replica);
    OMP_NUM_THREADS too, because libgomp read it when torch was imported and only processes
    started from now on (the spawned builder) see it."""
    if threads is None:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def kv_pool_views(kv_cache: torch.Tensor) -> list[torch.Tensor]:
    """[layers, 2, slots, KVH, D] -> [K0, V0, K1, V1, ...], views sharing the one allocation."""
    return [kv_cache[layer, kind] for layer in range(kv_cache.shape[0]) for kind in range(2)]


class Engine:
    """Owns the KV pool; `step` runs one packed batch and returns float32 logits [R, vocab]."""

    def __init__(self, config: EngineConfig, mode: StepMode = StepMode.COMPILED) -> None:
        self.config = config
        self.mode = mode
        self.backend: StepBackend = make_step_backend(config, mode)
        # In the engine's kv_dtype: the compiled step was exported with pools of that dtype.
        self.kv_cache = engine_kv_pool(config.spec, config.limits, config.kv_dtype, self.backend.device)
        self.kv_pools = kv_pool_views(self.kv_cache)

    @classmethod
    def load(cls, folder: str | Path, mode: StepMode = StepMode.COMPILED, verify: bool = True) -> Engine:
        return cls(EngineConfig.load(folder, verify=verify), mode)

    def step(self, inputs: StepInputs) -> torch.Tensor:
        """Raises ValueError (and runs nothing) when `inputs` exceed the engine's limits."""
        check_step_inputs(inputs, self.config.limits, self.config.spec.vocab_size)
        with torch.inference_mode():
            return self.backend(inputs, self.kv_pools)
