"""The KV pool's memory: zero pages that become resident only where a step writes them.

`torch.zeros` writes every byte, so a pool sized for full load was resident from the first
moment: 512 MiB for a 1B model's 8192 fp32 tokens before any request, and the whole pool again
inside `ifb build` (the export's sample pools, then calibration). An anonymous private mapping
reads as zeros, as the attention paths need (padded slots are masked, never garbage), and the
OS backs a page only when it is first written: an engine's resident memory follows the KV it
has used, and a build that touches a bounded part of the pool pays for that part alone.
"""

from __future__ import annotations

import math
import mmap

import torch

from ifb.runtime.engine_format import EngineLimits, ModelSpec, kv_pool_dtype, kv_pool_shape


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero-filled tensor of `shape`; on the CPU its pages are mapped on first write."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # flags: private, so a forked child (a compile worker) never shares the pool's pages
    memory = mmap.mmap(-1, count * itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer holds a reference to the mapping for as long as the tensor lives
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)


def engine_kv_pool(
    spec: ModelSpec, limits: EngineLimits, kv_dtype: str, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """An engine's zeroed pool [layers, K/V, slots, kv_heads, head_dim] of `kv_dtype` (a q8_0 pool:
    uint8 rows of each head's bytes, `kv_row_bytes`); the one place that turns a kv_dtype into a tensor."""
    return zeroed_pool(kv_pool_shape(spec, limits, kv_dtype), getattr(torch, kv_pool_dtype(kv_dtype)), device)
