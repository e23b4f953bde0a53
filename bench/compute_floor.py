"""The compute floor of an engine step: its multiply-adds at this machine's best measured rate.

A step's multiply-adds: every linear layer over the step's tokens (the LM head only over the
rows it samples) plus attention (query x key and probability x value over the keys each query
reads). The rates are measured in the same run on cache-resident operands, so they are what
this CPU can do, not a datasheet figure (a VM hides the clock): fp32 multiply-adds by torch's
own GEMM (oneDNN), int8 multiply-adds (`--compute int8` linears) by our int8 block kernel at
512 rows. Attention stays fp32 in every mode.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ifb.runtime.engine_format import EngineConfig

_RATE_ROWS, _RATE_K, _RATE_N = 512, 576, 384  # 0.9 MB of fp32 weights: resident in L2


@dataclass(frozen=True, slots=True)
class StepWork:
    """Multiply-adds of one step, split by the arithmetic that does them."""

    linear: int
    attention: int


@dataclass(frozen=True, slots=True)
class PeakRates:
    """Multiply-adds per second measured on this machine."""

    fp32: float
    int8: float | None  # None: the int8 kernel is not loaded (no int8 engine in this run)


def step_work(config: EngineConfig, num_tokens: int, sampled_rows: int, keys_per_query: float) -> StepWork:
    """`num_tokens` query tokens, `sampled_rows` of them through the LM head, each reading
    `keys_per_query` keys on average."""
    spec = config.spec
    q_width = spec.num_heads * spec.head_dim
    kv_width = spec.num_kv_heads * spec.head_dim
    per_layer = spec.hidden_size * (q_width + 2 * kv_width)  # qkv
    per_layer += q_width * spec.hidden_size  # o_proj
    per_layer += 3 * spec.hidden_size * spec.intermediate_size  # gate, up, down
    linear = num_tokens * per_layer * spec.num_layers + sampled_rows * spec.hidden_size * spec.vocab_size
    attention = int(2 * num_tokens * keys_per_query * q_width * spec.num_layers)
    return StepWork(linear, attention)


def _best_s(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls: a peak rate is what the machine can do, so noise from
    other work only ever slows a call down (the median of 7 varied 68-101 G/s between runs)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_peak_rates(repeats: int = 30) -> PeakRates:
    x = torch.randn(_RATE_ROWS, _RATE_K)
    w = torch.randn(_RATE_K, _RATE_N)
    work = _RATE_ROWS * _RATE_K * _RATE_N
    fp32 = work / _best_s(lambda: torch.mm(x, w), repeats)
    int8 = None
    if hasattr(torch.ops.ifb_quant, "quant_matmul_int8"):
        from ifb.plugins import quant_ops
        from ifb.plugins.quant_formats import WeightFormat, quantize

        fmt = WeightFormat.Q4_1
        packed = quant_ops.pack_int8(quantize(w.T.contiguous(), fmt), fmt, _RATE_N, _RATE_K)
        int8 = work / _best_s(lambda: quant_ops.quant_linear_int8(x, packed, fmt, _RATE_N, _RATE_K), repeats)
    return PeakRates(fp32, int8)


def compute_floor_ms(work: StepWork, rates: PeakRates, int8_linears: bool) -> float:
    linear_rate = rates.int8 if int8_linears and rates.int8 is not None else rates.fp32
    return 1000 * (work.linear / linear_rate + work.attention / rates.fp32)
