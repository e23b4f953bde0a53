"""Experiment for #39 (compile time independent of depth): the step's decoder layers as one
`while_loop` over stacked layer weights, compiled by AOTInductor, against today's unrolled graph.

Not the engine's code path: it subclasses StepNetwork with a looped forward to answer three
questions before the builder is changed: does AOTInductor (torch 2.13) compile a while_loop whose
body runs our custom ops and writes the KV pool, does the looped package give the unrolled one's
bits, and what do compile time and step time do with depth. The layer body is one layer module
called through `torch.func.functional_call` with layer k's weights as views (`select(0, k)`) of
stacked tensors, so the body is traced and compiled once whatever the depth.

    .venv/bin/python bench/layer_loop_experiment.py --layers 4 16 --weights q8_0

prints, for each depth and form, export and compile seconds, graph nodes, whether the logits
and written KV equal the eager unrolled network's, and the compiled step's time (the two
packages alternated in one process).

Measured on the Intel Xeon (AVX-512 VNNI, 2 cores, quiet: load ~1.2), hidden 256, 4 heads,
Q8_0 weights with int8 compute, Inductor's caches off, `--layers 2 16 32 --repeats 10` (the
first depth pays the process's one-time compile warm-up):

| layers | looped compile | unrolled compile | export looped / unrolled | graph nodes looped / unrolled | step ms looped / unrolled |
| --- | --- | --- | --- | --- | --- |
| 16 | 9.0 s | 24.6 s | 1.6 / 3.3 s | 146 / 1510 | 2.449 / 2.310 (1.06x) |
| 32 | 8.9 s | 46.0 s | 1.7 / 6.5 s | 242 / 2982 | 4.819 / 4.558 (1.06x) |

So the compile is independent of depth, and the looped package's logits and KV equal the eager
network's as the unrolled one's do; the looped step costs 6% more (the loop's per-layer views and
the moved block tables).

The pool: the looped step takes two pool inputs, every layer's K and every layer's V, as
[layers x slots, kv_heads, head_dim] (two allocations: a while_loop refuses inputs that alias
each other), writes at slot + layer x slots and reads through block tables moved by layer x
blocks. A first version wrote into layer k's view (`select`) of one pool input; Inductor
functionalized that into a select_scatter copying the whole pool in every layer (881 ms against
14 ms unrolled at 16 layers, under load) — nothing of the pool is viewed and written now.

What the builder would need (not done): the runtime's pool as two allocations (the prefix disk
tier and the accounting read [layers, K/V, ...] today); stacked weights as strided views of the
mapping (a stack-major weights file) rather than copies; layers that differ (Q4_K_M's Q6_K/Q4_K
mix, Gemma's sliding/global layers, NoPE layers) as a stack per layer signature and a branch
(torch.cond, which the C++ wrapper also generates) per signature in the body.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch._higher_order_ops.while_loop import while_loop

from ifb.builder.step_export import dynamic_shapes, sample_step_inputs
from ifb.plugins import quant_ops
from ifb.plugins.layout import AttentionLayout
from ifb.plugins.quant_build import build_quant_library, load_quant_library
from ifb.plugins.quant_formats import WeightCompute, WeightFormat, quantize
from ifb.runtime.engine_format import EngineLimits, ModelSpec
from ifb.runtime.step.engine import kv_pool_views
from ifb.runtime.step.network import FAST_OPS, KERNEL_OPS, StepNetwork, linear_part_rows
from ifb.runtime.step.quant_linear import QuantLinear

OUT = Path(__file__).parent / "out" / "layer_loop"
HEAD_DIM, SLOTS_PER_LAYER = 64, 64 * 16
LIMITS = EngineLimits(max_batch_size=8, max_num_tokens=64, max_seq_len=512, block_size=16, num_kv_blocks=64)


class LoopedStepNetwork(StepNetwork):
    """StepNetwork whose decoder layers run as one while_loop over stacked copies of their weights;
    the KV pool is one [layers, K/V, slots, kv_heads, head_dim] input."""

    def stack_layers(self) -> None:
        self.stacked_names = [name for name, _ in self.layers[0].named_parameters()]
        for name in self.stacked_names:
            per_layer = [dict(layer.named_parameters())[name].detach() for layer in self.layers]
            self.register_buffer(_buffer(name), torch.stack(per_layer), persistent=False)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_query_rows: torch.Tensor,
        context_block_tables: torch.Tensor,
        decode_query_rows: torch.Tensor,
        decode_block_tables: torch.Tensor,
        decode_seq_lens: torch.Tensor,
        logits_indices: torch.Tensor,
        kv_pools: list[torch.Tensor],
    ) -> torch.Tensor:
        layout = AttentionLayout(
            context_query_rows, context_block_tables, decode_query_rows, decode_block_tables, decode_seq_lens, positions
        )
        x = self.embed(input_ids)
        cos, sin = self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]  # (fp32 engines)
        stacks = [getattr(self, _buffer(name)) for name in self.stacked_names]
        template, num_layers = self.layers[0], len(self.layers)
        k_pool, v_pool = kv_pools
        slots_per_layer = k_pool.shape[0] // num_layers

        def more(i: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            return i < num_layers

        def layer(i: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k = i.item()
            torch._check(k >= 0)
            torch._check(k < num_layers)
            weights = {name: stack.select(0, k) for name, stack in zip(self.stacked_names, stacks, strict=True)}
            # Every layer's K (V) in one [layers * slots, ...] input, written in place at slot +
            # the layer's offset and read through block tables moved by as many blocks: no view
            # of the pool is written, so nothing is functionalized into a copy of it.
            layer_blocks = i * (slots_per_layer // template.attn.block_size)
            moved = AttentionLayout(
                layout.context_query_rows,
                layout.context_block_tables + layer_blocks,
                layout.decode_query_rows,
                layout.decode_block_tables + layer_blocks,
                layout.decode_seq_lens,
                positions,
            )
            slots = slot_mapping + i * slots_per_layer
            inputs = (h, cos, sin, positions, slots, moved, k_pool, v_pool)
            return i + 1, torch.func.functional_call(template, weights, inputs)

        _, x = while_loop(more, layer, (torch.zeros((), dtype=torch.int64), x))
        return self.lm_head(self.norm(x[logits_indices])).float()


def _buffer(name: str) -> str:
    return "stacked_" + name.replace(".", "_")


def _spec(num_layers: int) -> ModelSpec:
    return ModelSpec(
        architecture="llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def _network(cls: type[StepNetwork], num_layers: int, block: bool) -> StepNetwork:
    spec = _spec(num_layers)
    formats = dict.fromkeys(linear_part_rows(spec), WeightFormat.Q8_0) if block else None
    compute = WeightCompute.INT8 if block else WeightCompute.FP32
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    torch.manual_seed(0)  # the same weights for the looped and the unrolled network
    network = cls(spec, inv_freq, 1.0, 512, 16, KERNEL_OPS if block else FAST_OPS, formats, compute)
    for module in network.modules():
        if isinstance(module, QuantLinear):
            weight = torch.randn(module.out_features, module.in_features) * 0.08
            packed = quant_ops.pack_int8(
                quantize(weight, module.fmt), module.fmt, module.out_features, module.in_features
            )
            module.packed.data = packed
    for name, parameter in network.named_parameters():
        if not name.endswith("packed"):
            parameter.data.normal_(0, 0.08)
    return network.eval()


def _step_inputs() -> list[torch.Tensor]:
    inputs = list(sample_step_inputs(LIMITS).as_args())
    inputs[0] = torch.randint(0, 512, inputs[0].shape, generator=torch.Generator().manual_seed(1))
    inputs[4] = torch.tensor([[0, 1, 2], [3, 4, 5]])  # context requests' blocks
    inputs[6] = torch.arange(30).reshape(5, 6) + 6  # decode requests' blocks
    return inputs


def _compile(network: StepNetwork, looped: bool, num_layers: int, tag: str) -> tuple[Callable[..., torch.Tensor], str]:
    inputs = list(sample_step_inputs(LIMITS).as_args())
    shapes = dynamic_shapes(LIMITS, 2 if looped else 2 * num_layers)
    pools = _pools(num_layers, looped)
    started = time.perf_counter()
    exported = torch.export.export(network, (*inputs, pools), dynamic_shapes=shapes)
    exported_s = time.perf_counter() - started
    started = time.perf_counter()
    configs = quant_ops.aoti_configs() if network.weight_formats else None
    package = torch._inductor.aoti_compile_and_package(
        exported, package_path=str(OUT / f"{tag}.pt2"), inductor_configs=configs
    )
    compiled_s = time.perf_counter() - started
    line = f"export {exported_s:6.1f} s  compile {compiled_s:6.1f} s  nodes {len(exported.graph.nodes):5d}"
    return torch._inductor.aoti_load_package(package), line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--weights", choices=("fp32", "q8_0"), default="q8_0")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    # Inductor's own caches would serve the looped body compiled at one depth to the next depth
    torch._inductor.config.force_disable_caches = True
    block = args.weights == "q8_0"
    if block:
        library = build_quant_library(OUT / "kernels")
        load_quant_library(library.path, library.required_features)
    inputs = _step_inputs()
    for num_layers in args.layers:
        reference = _network(StepNetwork, num_layers, block)
        expected_pool = torch.zeros(num_layers, 2, SLOTS_PER_LAYER, 2, HEAD_DIM)
        with torch.no_grad():
            expected = reference(*inputs, kv_pool_views(expected_pool))
        steps: dict[str, Callable[[], torch.Tensor]] = {}
        for looped in (True, False):
            form = "looped" if looped else "unrolled"
            network = _network(LoopedStepNetwork if looped else StepNetwork, num_layers, block)
            if isinstance(network, LoopedStepNetwork):
                network.stack_layers()
            with torch.no_grad():
                runner, line = _compile(network, looped, num_layers, f"{form}-{num_layers}-{args.weights}")
            pools = _pools(num_layers, looped)
            logits = runner(*inputs, pools)
            logit_error = (logits - expected).abs().max().item()
            kv_error = (_by_layer(pools, num_layers) - expected_pool).abs().max().item()
            print(
                f"{num_layers:3d} layers {form:8s} {line}  |logits - eager| {logit_error:.1e}  |kv - eager| {kv_error:.1e}"
            )
            steps[form] = _bound(runner, inputs, pools)
        times = _alternated(steps, args.repeats)
        print(f"{num_layers:3d} layers step ms: " + "  ".join(f"{form} {ms:.3f}" for form, ms in times.items()))


def _pools(num_layers: int, looped: bool) -> list[torch.Tensor]:
    """The step's pool inputs: per layer K then V, views of one allocation (today's), or for the
    looped step every layer's K and every layer's V as two [layers * slots, kv_heads, head_dim]
    tensors (two allocations: a while_loop refuses inputs that alias each other)."""
    if looped:
        return [torch.zeros(num_layers * SLOTS_PER_LAYER, 2, HEAD_DIM) for _ in range(2)]
    return kv_pool_views(torch.zeros(num_layers, 2, SLOTS_PER_LAYER, 2, HEAD_DIM))


def _by_layer(pools: list[torch.Tensor], num_layers: int) -> torch.Tensor:
    """The pools as [layers, K/V, slots, kv_heads, head_dim]."""
    if len(pools) == 2 * num_layers:
        return torch.stack(pools).view(num_layers, 2, SLOTS_PER_LAYER, 2, HEAD_DIM)
    return torch.stack(pools).view(2, num_layers, SLOTS_PER_LAYER, 2, HEAD_DIM).transpose(0, 1)


def _bound(
    runner: Callable[..., torch.Tensor], inputs: list[torch.Tensor], pools: object
) -> Callable[[], torch.Tensor]:
    return lambda: runner(*inputs, pools)


def _alternated(steps: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {form: [] for form in steps}
    for _ in range(repeats):
        for form, step in steps.items():
            started = time.perf_counter()
            for _ in range(10):
                step()
            samples[form].append((time.perf_counter() - started) / 10 * 1e3)
    return {form: statistics.median(values) for form, values in samples.items()}


if __name__ == "__main__":
    main()
