"""Random GGUF blocks and activations shared by the block-kernel tests."""

from __future__ import annotations

import torch

from ifb.plugins.quant_formats import WeightFormat, block_bytes


def random_blocks(n: int, k: int, fmt: WeightFormat, seed: int) -> torch.Tensor:
    """Random quant bytes with finite fp16 scales (some zero, some subnormal) in GGUF layout."""
    generator = torch.Generator().manual_seed(seed)
    size = block_bytes(fmt)
    blocks = torch.randint(0, 256, (n * k // 32, size), dtype=torch.uint8, generator=generator)
    num_scales = 2 if fmt is WeightFormat.Q4_1 else 1
    scales = torch.randn(n * k // 32, num_scales, generator=generator) * 0.05
    scales[::7] = 0.0
    scales[1::11] = 3e-7  # fp16 subnormal
    blocks[:, : 2 * num_scales] = scales.to(torch.float16).view(torch.uint8)
    return blocks.reshape(n, -1)


def random_x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
