"""Random GGUF blocks and activations shared by the block-kernel tests."""

from __future__ import annotations

import torch

from ifb.plugins.quant_formats import WeightFormat, block_bytes, block_weights

# Byte offsets of each format's fp16 fields (d, m or dmin); every other byte may be anything.
_FP16_FIELDS = {
    WeightFormat.Q4_0: (0,),
    WeightFormat.Q4_1: (0, 2),
    WeightFormat.Q8_0: (0,),
    WeightFormat.Q5_0: (0,),
    WeightFormat.Q5_1: (0, 2),
    WeightFormat.Q4_K: (0, 2),
    WeightFormat.Q5_K: (0, 2),
    WeightFormat.Q6_K: (208,),
    WeightFormat.MXFP4: (),
}


def random_blocks(n: int, k: int, fmt: WeightFormat, seed: int) -> torch.Tensor:
    """Random quant and scale bytes with finite fp16 scales (some zero, some subnormal) in GGUF layout;
    MXFP4's e8m0 scales 2^-13 .. 2^-1 (times its values up to 12), some 2^-128 and 2^-127 (subnormal)."""
    generator = torch.Generator().manual_seed(seed)
    size = block_bytes(fmt)
    num_blocks = n * k // block_weights(fmt)
    blocks = torch.randint(0, 256, (num_blocks, size), dtype=torch.uint8, generator=generator)
    if fmt is WeightFormat.MXFP4:
        blocks[:, 0] = torch.randint(115, 128, (num_blocks,), dtype=torch.uint8, generator=generator)
        blocks[::7, 0] = 0
        blocks[1::11, 0] = 1
        return blocks.reshape(n, -1)
    offsets = _FP16_FIELDS[fmt]
    # Smaller for the K-quants, whose 6-8 bit scales multiply d again.
    spread = 0.05 if block_weights(fmt) == 32 else 0.002
    scales = torch.randn(num_blocks, len(offsets), generator=generator) * spread
    scales[::7] = 0.0
    scales[1::11] = 3e-7  # fp16 subnormal
    halves = scales.to(torch.float16).view(torch.uint8).reshape(num_blocks, len(offsets), 2)
    for index, offset in enumerate(offsets):
        blocks[:, offset : offset + 2] = halves[:, index]
    return blocks.reshape(n, -1)


def random_x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
