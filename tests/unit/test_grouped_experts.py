"""The grouped mixture-of-experts op (plugins/grouped_experts.py, csrc/grouped_experts.cpp).

Pins: the op is the per-row, per-expert definition (float64 reference from the weights the kernel
reads: dense, or the blocks dequantized) for dense experts and block formats in both compute modes;
a row's bits are the same alone and in a batch (rows sharing its experts or not, in any order);
a step where no row selects some experts never reads those experts' weights (NaN weights there do
not reach the output), and one where every row selects the same expert is still each row alone.
The variant op (gpt-oss: clamped SwiGLU, per-expert biases) the same, every case again; its
fields are parsed by name (unknown ones refused), and with the plain fields and no bias it is the
plain op bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from quant_cases import random_blocks, random_x

from ifb.plugins import quant_ops
from ifb.plugins.grouped_experts import (
    ExpertActivation,
    ExpertVariant,
    expert_format,
    grouped_experts,
    grouped_experts_call,
    reference_grouped_experts,
)
from ifb.plugins.quant_build import QuantLibrary
from ifb.plugins.quant_formats import WeightCompute, WeightFormat, dequantize, quantize, quantize_mxfp4

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 64, 64, 6, 2
DENSE = WeightFormat.FP32
# (weight format, compute mode): every compute mode each weight path has; None: dense bfloat16
# (a 16-bit engine's dense experts, widened exactly inside the op)
CASES = [
    (DENSE, WeightCompute.FP32),
    (None, WeightCompute.FP32),
    (WeightFormat.Q8_0, WeightCompute.FP32),
    (WeightFormat.Q8_0, WeightCompute.INT8),
    (WeightFormat.Q4_0, WeightCompute.FP32),
    (WeightFormat.Q4_0, WeightCompute.INT8),
    (WeightFormat.MXFP4, WeightCompute.FP32),  # gpt-oss's experts
    (WeightFormat.MXFP4, WeightCompute.INT8),
]
IDS = [f"{fmt.value if fmt else 'bf16'}-{compute.value}" for fmt, compute in CASES]


class Experts:
    """Random stacked experts as the op takes them, and the exact fp32 weights the kernel reads."""

    def __init__(self, fmt: WeightFormat | None, compute: WeightCompute, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * HIDDEN**-0.5
        down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * INTERMEDIATE**-0.5
        self.fmt, self.compute = fmt or DENSE, compute
        if fmt is None:
            self.gate_up, self.down = gate_up.bfloat16().contiguous(), down.bfloat16().contiguous()
            self.exact = (self.gate_up.float(), self.down.float())
            return
        if fmt is DENSE:
            self.gate_up, self.down = gate_up.contiguous(), down.contiguous()
            self.exact = (gate_up, down)
            return
        packer = quant_ops.pack_int8 if compute is WeightCompute.INT8 else quant_ops.pack
        stacked, exact = [], []
        for weights in (gate_up, down):
            blocks = [quantize_mxfp4(w) if fmt is WeightFormat.MXFP4 else quantize(w, fmt) for w in weights]
            n, k = weights.shape[1:]
            stacked.append(torch.stack([packer(b, fmt, n, k) for b in blocks]).contiguous())
            exact.append(torch.stack([dequantize(b, fmt).reshape(n, k) for b in blocks]))
        self.gate_up, self.down = stacked
        self.exact = (exact[0], exact[1])

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return grouped_experts(
            x, ids, weights, self.gate_up, self.down, (self.fmt, self.fmt), self.compute, INTERMEDIATE
        )

    def reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return reference_grouped_experts(x, ids, weights, *self.exact, INTERMEDIATE)


def routing(
    rows: int, seed: int, experts: tuple[int, ...] = tuple(range(EXPERTS))
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k ids per row drawn from `experts`, and softmax-like weights summing to 1."""
    generator = torch.Generator().manual_seed(seed)
    choices = torch.tensor(experts)
    ids = torch.stack([choices[torch.randperm(len(experts), generator=generator)[:TOP_K]] for _ in range(rows)])
    weights = torch.softmax(torch.randn(rows, TOP_K, generator=generator), dim=-1)
    return ids.to(torch.int64), weights


@pytest.mark.parametrize(("fmt", "compute"), CASES, ids=IDS)
def test_the_op_is_the_per_row_per_expert_definition(
    quant_library: QuantLibrary, fmt: WeightFormat | None, compute: WeightCompute
) -> None:
    """Against float64 on the kernel's exact weights: fp32 rounding only (dense, block fp32), or
    the int8 activations' quantization (~1% of the output's scale)."""
    experts = Experts(fmt, compute)
    x = random_x(13, HIDDEN, seed=3)
    ids, weights = routing(13, seed=4)
    ours = experts(x, ids, weights).double()
    expected = experts.reference(x, ids, weights)
    error = (ours - expected).abs().max().item() / expected.abs().max().item()
    assert error < (2e-2 if compute is WeightCompute.INT8 else 1e-5), error


@pytest.mark.parametrize(("fmt", "compute"), CASES, ids=IDS)
def test_a_rows_bits_are_the_same_alone_and_in_any_batch(
    quant_library: QuantLibrary, fmt: WeightFormat | None, compute: WeightCompute
) -> None:
    experts = Experts(fmt, compute, seed=1)
    x = random_x(21, HIDDEN, seed=5)
    ids, weights = routing(21, seed=6)
    batched = experts(x, ids, weights)
    reversed_rows = experts(x.flip(0), ids.flip(0), weights.flip(0)).flip(0)
    for row in range(21):
        alone = experts(x[row : row + 1], ids[row : row + 1], weights[row : row + 1])
        assert torch.equal(alone[0], batched[row]), row
        assert torch.equal(alone[0], reversed_rows[row]), row


@pytest.mark.parametrize(("fmt", "compute"), CASES, ids=IDS)
def test_a_rows_bits_do_not_depend_on_the_thread_count(
    quant_library: QuantLibrary, fmt: WeightFormat | None, compute: WeightCompute
) -> None:
    """Each matmul phase deals every selected expert's tiles to the threads by work, in one
    parallel region: the split moves with the thread count, a row's bits do not (19 rows, so the
    experts' row counts differ and the parts' boundaries fall inside experts)."""
    experts = Experts(fmt, compute, seed=2)
    x = random_x(19, HIDDEN, seed=7)
    ids, weights = routing(19, seed=8)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(experts(x, ids, weights))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize(("fmt", "compute"), CASES, ids=IDS)
def test_experts_no_row_selects_are_not_read(
    quant_library: QuantLibrary, fmt: WeightFormat | None, compute: WeightCompute
) -> None:
    """Rows routed to experts 0-2 only: experts 3-5 hold NaN (dense) or NaN scales (blocks), and the
    output is finite and the rows' own."""
    experts = Experts(fmt, compute, seed=2)
    x = random_x(9, HIDDEN, seed=7)
    ids, weights = routing(9, seed=8, experts=(0, 1, 2))
    clean = experts(x, ids, weights)
    if fmt is DENSE or fmt is None:
        experts.gate_up[3:] = float("nan")
        experts.down[3:] = float("nan")
    else:  # every byte 0xFF: every fp16 scale field is a NaN (MXFP4: scale 2^127, weights -inf)
        experts.gate_up[3:] = 255
        experts.down[3:] = 255
    poisoned = experts(x, ids, weights)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)
    every = torch.full((1, TOP_K), 4, dtype=torch.int64)
    every[0, 1] = 5
    assert not torch.isfinite(experts(x[:1], every, weights[:1])).all()  # the poison is read when selected


@pytest.mark.parametrize(("fmt", "compute"), CASES, ids=IDS)
def test_every_row_on_the_same_expert_is_each_row_alone(
    quant_library: QuantLibrary, fmt: WeightFormat | None, compute: WeightCompute
) -> None:
    experts = Experts(fmt, compute, seed=3)
    rows = 17
    x = random_x(rows, HIDDEN, seed=9)
    ids = torch.stack([torch.tensor([2, (row % (EXPERTS - 1) + 3) % EXPERTS]) for row in range(rows)]).to(torch.int64)
    weights = torch.softmax(torch.randn(rows, TOP_K, generator=torch.Generator().manual_seed(10)), dim=-1)
    batched = experts(x, ids, weights)
    for row in range(rows):
        assert torch.equal(experts(x[row : row + 1], ids[row : row + 1], weights[row : row + 1])[0], batched[row])
    expected = experts.reference(x, ids, weights)
    error = (batched.double() - expected).abs().max().item() / expected.abs().max().item()
    assert error < (2e-2 if compute is WeightCompute.INT8 else 1e-5), error


def test_an_expert_id_outside_the_experts_is_refused(quant_library: QuantLibrary) -> None:
    experts = Experts(DENSE, WeightCompute.FP32)
    x = random_x(2, HIDDEN, seed=11)
    ids, weights = routing(2, seed=12)
    ids[1, 0] = EXPERTS
    with pytest.raises(RuntimeError, match=f"expert id {EXPERTS} of row 1 is outside"):
        experts(x, ids, weights)


@pytest.mark.parametrize("compute", [WeightCompute.FP32, WeightCompute.INT8], ids=["fp32", "int8"])
def test_k_quant_experts_of_two_formats(quant_library: QuantLibrary, compute: WeightCompute) -> None:
    """Q4_K_M's expert layout: gate/up Q4_K, down Q6_K (256-weight super-blocks, so 256 wide):
    the definition on the blocks' exact weights, and each row's bits alone as in the batch."""
    width, experts = 256, 3
    packer = quant_ops.pack_int8 if compute is WeightCompute.INT8 else quant_ops.pack
    stacked, exact = [], []
    for index, (fmt, n, k) in enumerate(((WeightFormat.Q4_K, 2 * width, width), (WeightFormat.Q6_K, width, width))):
        blocks = [random_blocks(n, k, fmt, seed=10 * index + e) for e in range(experts)]
        stacked.append(torch.stack([packer(b, fmt, n, k) for b in blocks]).contiguous())
        exact.append(torch.stack([dequantize(b, fmt).reshape(n, k) for b in blocks]))
    x = random_x(7, width, seed=13)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0], [1, 2], [0, 2]], dtype=torch.int64)
    weights = torch.softmax(torch.randn(7, 2, generator=torch.Generator().manual_seed(14)), dim=-1)
    formats = (WeightFormat.Q4_K, WeightFormat.Q6_K)
    ours = grouped_experts(x, ids, weights, stacked[0], stacked[1], formats, compute, width)
    expected = reference_grouped_experts(x, ids, weights, exact[0], exact[1], width)
    error = (ours.double() - expected).abs().max().item() / expected.abs().max().item()
    assert error < (2e-2 if compute is WeightCompute.INT8 else 1e-5), error
    for row in range(7):
        alone = grouped_experts(
            x[row : row + 1], ids[row : row + 1], weights[row : row + 1], *stacked, formats, compute, width
        )
        assert torch.equal(alone[0], ours[row]), row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_activations_are_widened_and_the_result_rounded_inside(
    quant_library: QuantLibrary, dtype: torch.dtype
) -> None:
    """A 16-bit engine passes x and the routing weights in its dtype: the result is the float32
    op on them widened, rounded to that dtype once (bit for bit), so a compiled graph has no cast
    around the op to fuse away. Routing weights of another dtype than x are refused by name."""
    experts = Experts(None, WeightCompute.FP32, seed=4)
    x = random_x(11, HIDDEN, seed=13).to(dtype)
    ids, weights = routing(11, seed=14)
    weights = weights.to(dtype)
    ours = experts(x, ids, weights)
    assert ours.dtype == dtype
    assert torch.equal(ours, experts(x.float(), ids, weights.float()).to(dtype))
    with pytest.raises(RuntimeError, match="expert_weights must be"):
        experts(x, ids, weights.float())


# gpt-oss's alpha; a limit of 1 (gpt-oss: 7) so the clamps act on these unit-scale activations:
# VariantExperts.clamped says how often
CLAMPED = ExpertVariant(ExpertActivation.SWIGLU_CLAMPED, alpha=1.702, limit=1.0)


class VariantExperts(Experts):
    """Experts of the variant op: the clamped SwiGLU and random O(1) biases on gate/up and down."""

    def __init__(self, fmt: WeightFormat | None, compute: WeightCompute, seed: int = 0) -> None:
        super().__init__(fmt, compute, seed)
        generator = torch.Generator().manual_seed(100 + seed)
        self.gate_up_bias = torch.randn(EXPERTS, 2 * INTERMEDIATE, generator=generator) * 0.5
        self.down_bias = torch.randn(EXPERTS, HIDDEN, generator=generator) * 0.5
        if fmt is None:  # a 16-bit engine holds its biases in its dtype too
            self.gate_up_bias, self.down_bias = self.gate_up_bias.bfloat16(), self.down_bias.bfloat16()

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        formats = (self.fmt, self.fmt)
        return grouped_experts_call(
            x, ids, weights, self.gate_up, self.down, formats, self.compute, INTERMEDIATE, CLAMPED,
            self.gate_up_bias, self.down_bias,
        )  # fmt: skip

    def reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return reference_grouped_experts(
            x, ids, weights, *self.exact, INTERMEDIATE, CLAMPED, self.gate_up_bias.float(), self.down_bias.float()
        )

    def clamped(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[float, float]:
        """The fractions of the selected experts' gate values above the limit and up values outside it."""
        h = torch.stack([x[r] @ self.exact[0][e].T + self.gate_up_bias[e].float() for r, e in _pairs(ids)])
        gate, up = h[:, :INTERMEDIATE], h[:, INTERMEDIATE:]
        assert CLAMPED.limit is not None
        return (gate > CLAMPED.limit).float().mean().item(), (up.abs() > CLAMPED.limit).float().mean().item()


def _pairs(ids: torch.Tensor) -> list[tuple[int, int]]:
    return [(row, int(e)) for row in range(ids.shape[0]) for e in ids[row]]


@pytest.mark.parametrize(("fmt", "compute"), CASES, ids=IDS)
def test_the_variant_is_the_per_row_per_expert_definition(
    quant_library: QuantLibrary, fmt: WeightFormat | None, compute: WeightCompute
) -> None:
    """Clamped SwiGLU and both biases against float64 on the kernel's exact weights, on rows where
    the clamps act (a tenth or more of the gate and up values past the limit); and the op moves by
    far more than the tolerance when a bias or the clamp is left out of the reference."""
    experts = VariantExperts(fmt, compute)
    x = random_x(13, HIDDEN, seed=3)
    ids, weights = routing(13, seed=4)
    gate_clamped, up_clamped = experts.clamped(x, ids)
    assert gate_clamped > 0.1 and up_clamped > 0.1, (gate_clamped, up_clamped)
    ours = experts(x, ids, weights).double()
    tolerance = 2e-2 if compute is WeightCompute.INT8 else 1e-5

    def error(expected: torch.Tensor) -> float:
        return (ours - expected).abs().max().item() / expected.abs().max().item()

    assert error(experts.reference(x, ids, weights)) < tolerance
    unclamped = ExpertVariant(ExpertActivation.SWIGLU_CLAMPED, alpha=1.702, limit=1e9)
    gate_up_bias, down_bias = experts.gate_up_bias.float(), experts.down_bias.float()
    wrong = {
        "no gate/up bias": reference_grouped_experts(x, ids, weights, *experts.exact, INTERMEDIATE, CLAMPED, None, down_bias),
        "no down bias": reference_grouped_experts(x, ids, weights, *experts.exact, INTERMEDIATE, CLAMPED, gate_up_bias, None),
        "no clamp": reference_grouped_experts(
            x, ids, weights, *experts.exact, INTERMEDIATE, unclamped, gate_up_bias, down_bias
        ),
    }  # fmt: skip
    for what, expected in wrong.items():
        assert error(expected) > 10 * tolerance, what


@pytest.mark.parametrize(("fmt", "compute"), CASES, ids=IDS)
def test_a_rows_bits_are_the_same_alone_and_in_any_batch_with_the_variant(
    quant_library: QuantLibrary, fmt: WeightFormat | None, compute: WeightCompute
) -> None:
    experts = VariantExperts(fmt, compute, seed=1)
    x = random_x(21, HIDDEN, seed=5)
    ids, weights = routing(21, seed=6)
    batched = experts(x, ids, weights)
    reversed_rows = experts(x.flip(0), ids.flip(0), weights.flip(0)).flip(0)
    for row in range(21):
        alone = experts(x[row : row + 1], ids[row : row + 1], weights[row : row + 1])
        assert torch.equal(alone[0], batched[row]), row
        assert torch.equal(alone[0], reversed_rows[row]), row


@pytest.mark.parametrize(("fmt", "compute"), CASES, ids=IDS)
def test_the_variants_unselected_experts_and_their_biases_are_not_read(
    quant_library: QuantLibrary, fmt: WeightFormat | None, compute: WeightCompute
) -> None:
    """Rows routed to experts 0-2 only: experts 3-5's weights and biases NaN, the output the clean
    one; selected, the poison shows."""
    experts = VariantExperts(fmt, compute, seed=2)
    x = random_x(9, HIDDEN, seed=7)
    ids, weights = routing(9, seed=8, experts=(0, 1, 2))
    clean = experts(x, ids, weights)
    if fmt is DENSE or fmt is None:
        experts.gate_up[3:] = float("nan")
        experts.down[3:] = float("nan")
    else:
        experts.gate_up[3:] = 255
        experts.down[3:] = 255
    experts.gate_up_bias[3:] = float("nan")
    experts.down_bias[3:] = float("nan")
    poisoned = experts(x, ids, weights)
    assert torch.equal(poisoned, clean)
    every = torch.tensor([[4, 5]], dtype=torch.int64)
    assert not torch.isfinite(experts(x[:1], every, weights[:1])).all()


@pytest.mark.parametrize(("fmt", "compute"), CASES, ids=IDS)
def test_every_row_on_the_same_expert_with_the_variant_is_each_row_alone(
    quant_library: QuantLibrary, fmt: WeightFormat | None, compute: WeightCompute
) -> None:
    experts = VariantExperts(fmt, compute, seed=3)
    rows = 17
    x = random_x(rows, HIDDEN, seed=9)
    ids = torch.stack([torch.tensor([2, (row % (EXPERTS - 1) + 3) % EXPERTS]) for row in range(rows)]).to(torch.int64)
    weights = torch.softmax(torch.randn(rows, TOP_K, generator=torch.Generator().manual_seed(10)), dim=-1)
    batched = experts(x, ids, weights)
    for row in range(rows):
        assert torch.equal(experts(x[row : row + 1], ids[row : row + 1], weights[row : row + 1])[0], batched[row])
    expected = experts.reference(x, ids, weights)
    error = (batched.double() - expected).abs().max().item() / expected.abs().max().item()
    assert error < (2e-2 if compute is WeightCompute.INT8 else 1e-5), error


@pytest.mark.parametrize(("fmt", "compute"), CASES, ids=IDS)
def test_the_plain_fields_without_biases_are_the_plain_op_bit_for_bit(
    quant_library: QuantLibrary, fmt: WeightFormat | None, compute: WeightCompute
) -> None:
    experts = Experts(fmt, compute, seed=5)
    x = random_x(11, HIDDEN, seed=15)
    ids, weights = routing(11, seed=16)
    plain = experts(x, ids, weights)
    formats = (expert_format(experts.fmt), expert_format(experts.fmt))
    for fields in ("", "act=swiglu"):
        variant = torch.ops.ifb_quant.grouped_experts_variant(
            x, ids, weights, experts.gate_up, experts.down, *formats, experts.compute.value, INTERMEDIATE,
            fields, None, None,
        )  # fmt: skip
        assert torch.equal(variant, plain), fields


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ("act=gelu", "unknown grouped_experts activation 'gelu'"),
        ("act=swiglu_clamped;alpha=1.702;limit=7;beta=2", "unknown grouped_experts variant field 'beta'"),
        ("act=swiglu_clamped;alpha=1.702", "alpha and limit go with act=swiglu_clamped, and only with it"),
        ("act=swiglu;limit=7", "alpha and limit go with act=swiglu_clamped, and only with it"),
        ("act=swiglu_clamped;alpha=fast;limit=7", "'alpha' needs a finite number, got 'fast'"),
        ("act=swiglu;act=swiglu", "repeats 'act'"),
        ("swiglu", "'swiglu' is not name=value"),
    ],
)
def test_variant_fields_are_read_by_name_and_the_unknown_refused(
    quant_library: QuantLibrary, fields: str, message: str
) -> None:
    experts = Experts(DENSE, WeightCompute.FP32)
    x = random_x(2, HIDDEN, seed=17)
    ids, weights = routing(2, seed=18)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.ifb_quant.grouped_experts_variant(
            x, ids, weights, experts.gate_up, experts.down, "fp32", "fp32", "fp32", INTERMEDIATE, fields, None, None
        )


def test_a_bias_of_the_wrong_shape_is_refused(quant_library: QuantLibrary) -> None:
    experts = VariantExperts(DENSE, WeightCompute.FP32)
    x = random_x(2, HIDDEN, seed=19)
    ids, weights = routing(2, seed=20)
    experts.down_bias = experts.down_bias[:, :-1]
    with pytest.raises(RuntimeError, match=rf"down_bias must be a CPU float tensor \[{EXPERTS}, {HIDDEN}\]"):
        experts(x, ids, weights)


def test_the_variant_fields_are_the_kernels_names() -> None:
    """ExpertVariant writes what the kernel parses; alpha/limit only beside the clamped activation."""
    assert CLAMPED.fields == "act=swiglu_clamped;alpha=1.702;limit=1.0"
    assert ExpertVariant().fields == "act=swiglu"
    with pytest.raises(ValueError, match="alpha and limit go with swiglu_clamped"):
        ExpertVariant(ExpertActivation.SWIGLU, alpha=1.0, limit=1.0)
