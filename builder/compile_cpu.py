"""The CPU backend: export the step network with bounded dynamic shapes, compile it ahead of time.

AOTInductor with freezing turns the network into a shared library whose weights are constants
prepacked for this CPU's matrix units (oneDNN/AMX for bf16); `ifb run` loads the package
without recompiling.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.export import Dim

from ifb.builder.limits import EngineLimits
from ifb.builder.network import StepNetwork

logger = logging.getLogger(__name__)

# Sample sizes are distinct and >= 2 so export keeps every dimension symbolic.
_T, _BC, _Q, _MC, _BD, _MD, _R = 11, 2, 4, 3, 5, 6, 7


# Freezing folds the weights in as constants and prepacks them (MKL for fp32, oneDNN for bf16).
# max_autotune with Inductor's C++ GEMM templates was measured too: on the full SmolLM2 step it
# picked kernels no faster than the packed MKL ones (decode b1/b8/b32: 23/47/147 ms vs
# 26/44/133 ms) and added a minute of compile, so it stays off.
INDUCTOR_CONFIGS = {"freezing": True}


def _long(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def kv_pool_views(kv_cache: torch.Tensor) -> list[torch.Tensor]:
    """[layers, 2, slots, KVH, D] -> [K0, V0, K1, V1, ...], views sharing the one allocation."""
    return [kv_cache[layer, kind] for layer in range(kv_cache.shape[0]) for kind in range(2)]


def sample_step_inputs(limits: EngineLimits, kv_cache: torch.Tensor) -> tuple[object, ...]:
    """A mixed step: two context chunks (4 and 2 tokens, padded) and five decodes."""
    bs = limits.block_size
    positions = [0, 1, 2, 3, bs, bs + 1] + [bs * 2 + i for i in range(_BD)]
    slot_mapping = list(range(_T))
    return (
        torch.zeros(_T, dtype=torch.long),
        _long(positions),
        _long(slot_mapping),
        _long([[0, 1, 2, 3], [4, 5, 5, 5]]),
        torch.zeros(_BC, _MC, dtype=torch.long),
        _long(list(range(6, 6 + _BD))),
        torch.zeros(_BD, _MD, dtype=torch.long),
        _long([bs * 2 + i + 1 for i in range(_BD)]),
        _long([3, 5, 6, 7, 8, 9, 10]),
        kv_pool_views(kv_cache),
    )


def dynamic_shapes(limits: EngineLimits, num_pools: int) -> tuple[object, ...]:
    """Every step dimension bounded by a baked limit (never below the sample size)."""
    tokens = Dim("num_tokens", min=1, max=max(limits.max_num_tokens, _T))
    num_context = Dim("num_context", min=0, max=max(limits.max_batch_size, _BC))
    chunk = Dim("max_chunk_len", min=1, max=max(limits.max_num_tokens, _Q))
    context_blocks = Dim("context_blocks", min=1, max=max(limits.max_blocks_per_seq, _MC))
    num_decode = Dim("num_decode", min=0, max=max(limits.max_batch_size, _BD))
    decode_blocks = Dim("decode_blocks", min=1, max=max(limits.max_blocks_per_seq, _MD))
    num_logits = Dim("num_logits", min=1, max=max(limits.max_batch_size, _R))
    return (
        {0: tokens},
        {0: tokens},
        {0: tokens},
        {0: num_context, 1: chunk},
        {0: num_context, 1: context_blocks},
        {0: num_decode},
        {0: num_decode, 1: decode_blocks},
        {0: num_decode},
        {0: num_logits},
        [None] * num_pools,
    )


def compile_cpu_engine(network: StepNetwork, limits: EngineLimits, kv_cache: torch.Tensor, package_path: Path) -> Path:
    """Export and AOT-compile `network` into a .pt2 package at `package_path`."""
    network.eval()
    sample = sample_step_inputs(limits, kv_cache)
    with torch.no_grad():
        exported = torch.export.export(network, sample, dynamic_shapes=dynamic_shapes(limits, 2 * kv_cache.shape[0]))
        logger.info("exported step graph with %d nodes", len(exported.graph.nodes))
        path = torch._inductor.aoti_compile_and_package(
            exported,
            package_path=str(package_path),
            inductor_configs=INDUCTOR_CONFIGS,
        )
    return Path(path)
