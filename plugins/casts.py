"""A dtype cast that leaves nothing in an exported graph when there is nothing to cast.

Eager `x.to(dtype)` returns x itself when it already has that dtype, but torch.export records the
call anyway, as two nodes (`aten.to.dtype` and an `_assert_tensor_metadata`), which AOTInductor
traces once more before its lowering drops them. An fp32 engine's step held ten such casts a
decoder layer: 610 of SmolLM2's 2,797 exported nodes (22%). The dtypes are known while tracing,
so the branch below is decided then and a no-op cast is simply not recorded.
"""

from __future__ import annotations

import torch


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as `dtype`: x itself where it has that dtype already (as eager `to`), else the cast."""
    return x if x.dtype == dtype else x.to(dtype)
