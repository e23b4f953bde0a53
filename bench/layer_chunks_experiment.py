"""Experiment for #39 (compile time independent of depth): a built engine's step as three compiled
graphs, the embedding, ONE chunk of K decoder layers and the head, with the chunk's model library
loaded as L/K AOTInductor containers, each bound by name to its own layers' weights. Against the
engine's own unrolled step, on the same inputs.

The chunk and head graphs are the product's since stop 56 (runtime/step/layer_chunks.py, which
`ifb build` now compiles where builder/layer_chunk_plan.py finds it pays); the embedding package is
this experiment's own (the product runs it eagerly). It answered, before the builder is changed: what the three graphs cost
to compile against the unrolled step's compile (the build's compile phase, printed by `ifb build`),
whether the chunked step gives the unrolled step's logits bit for bit, and what the extra container
runs cost a step. Unlike bench/layer_loop_experiment.py's while_loop, nothing about the weights
file or the KV pools changes: the containers take the engine's per-layer pools and bind the mapped
weights file's tensors, as AotiStep binds a weightless package's constants today.

    .venv/bin/python bench/layer_chunks_experiment.py ENGINE_DIR --chunk-layers 6 [--rounds 6]
    .venv/bin/python bench/layer_chunks_experiment.py --run-cost      # one container run's own cost

ENGINE_DIR: a CPU engine with block-quantized weights (its package is weightless), e.g. one
`ifb build -o DIR --calibration serve` of the bundled SmolLM2. K must divide the layer count, and
the layers must be alike (same formats and attention kind); the experiment checks both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from ifb.builder.compile_cpu import INDUCTOR_CONFIGS, compile_cpu_engine
from ifb.builder.concurrent_objects import concurrent_object_builds
from ifb.builder.step_export import dynamic_shapes, sample_step_inputs
from ifb.plugins import quant_ops
from ifb.runtime.step.aoti_step import AotiStep, _Container, _extract_model_library
from ifb.runtime.step.backend import NetworkStep, StepMode
from ifb.runtime.step.engine import Engine, kv_pool_views
from ifb.runtime.step.kv_pool import engine_kv_pool
from ifb.runtime.step.layer_chunks import HeadNetwork, LayerChunkNetwork
from ifb.runtime.step.network import StepNetwork
from ifb.runtime.step.step_inputs import RequestSlice, StepInputs, build_step_inputs

sys.path.insert(0, str(Path(__file__).parent))
from step import CONTEXT, PREFILL, decode_inputs, median_ms  # noqa: E402

OUT = Path(__file__).parent / "out" / "layer_chunks"


class EmbedGraph(nn.Module):
    def __init__(self, network: StepNetwork) -> None:
        super().__init__()
        self.embed, self.spec = network.embed, network.spec
        # a tied block embedding reads the head's tiles, which it does not register: registered
        # here, they are a named constant rather than a lifted one the binding could not name
        self.lm_head = network.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        if self.spec.embed_scale is not None:
            x = x * torch.full((), self.spec.embed_scale, dtype=x.dtype, device=x.device)
        return x


def _compile(module: nn.Module, args: tuple[object, ...], shapes: tuple[object, ...], tag: str) -> tuple[Path, str]:
    configs = {
        **INDUCTOR_CONFIGS,
        **quant_ops.aoti_configs(),
        "aot_inductor.package_constants_in_so": False,
        "freezing": False,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    package = OUT / f"{tag}.pt2"
    started = time.perf_counter()
    with torch.no_grad():
        exported = torch.export.export(module.eval(), args, dynamic_shapes=shapes)
        exported_s = time.perf_counter() - started
        with concurrent_object_builds():
            torch._inductor.aoti_compile_and_package(exported, package_path=str(package), inductor_configs=configs)
    total_s = time.perf_counter() - started
    return (
        package,
        f"{tag:6s} nodes {len(exported.graph.nodes):5d}  export {exported_s:5.1f} s  export+compile {total_s:5.1f} s",
    )


def _constants(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


class ChunkedStep:
    """embed -> chunk containers in layer order -> head, each an AotiStep's container."""

    def __init__(self, network: StepNetwork, packages: dict[str, Path], chunk_layers: int) -> None:
        self.chunk_layers = chunk_layers
        self.embed = AotiStep(packages["embed"], _constants(EmbedGraph(network)))
        self.head = AotiStep(packages["head"], _constants(HeadNetwork(network)))
        self.chunks = [
            AotiStep(packages["chunk"], _constants(LayerChunkNetwork(network, first, chunk_layers)))
            for first in range(0, len(network.layers), chunk_layers)
        ]

    def __call__(self, inputs: StepInputs, kv_pools: list[torch.Tensor]) -> torch.Tensor:
        args = inputs.as_args()
        (x,) = self.embed._container.run([args[0]])
        per_step = list(args[1:8])
        pools_per_chunk = 2 * self.chunk_layers
        for index, chunk in enumerate(self.chunks):
            pools = kv_pools[index * pools_per_chunk : (index + 1) * pools_per_chunk]
            (x,) = chunk._container.run([x, *per_step, *pools])
        (logits,) = self.head._container.run([x, args[8]])
        return logits


class _TinyStep(nn.Module):
    """A chunk's inputs with next to no work: a pointwise op and one row written to each pool."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(576), requires_grad=False)

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        positions, slots, pools = rest[0], rest[1], rest[6:]
        y = x * self.weight + positions[:, None].float()
        for pool in pools:
            pool.index_copy_(0, slots, y[:, :64].reshape(-1, 1, 64).expand(-1, 3, 64))
        return y


def container_run_cost(num_pools: int, runs: int = 2000) -> None:
    """The median time of one container run through `_Container` (ctypes, no GIL) of a package
    that takes a chunk's 7 per-step tensors and `num_pools` pools but does almost nothing: what
    each extra container a step runs costs, whatever it computes. Six containers of one library
    are run in turn, as a chunked step runs them, and one alone."""
    rows = 4
    sample = (
        torch.randn(rows, 576),
        *(torch.arange(rows) for _ in range(3)),
        torch.zeros(rows, 8, dtype=torch.long),
        torch.ones(rows, dtype=torch.long),
        torch.arange(rows),
        *(torch.zeros(1024, 3, 64) for _ in range(num_pools)),
    )
    OUT.mkdir(parents=True, exist_ok=True)
    package = OUT / f"run_cost_{num_pools}.pt2"
    torch._inductor.aoti_compile_and_package(torch.export.export(_TinyStep(), sample), package_path=str(package))
    library = _extract_model_library(package, OUT / f"run_cost_{num_pools}")
    containers = [_Container(library) for _ in range(6)]
    inputs = list(sample)
    for _ in range(200):  # warm: the first runs after a compile are slower
        for container in containers:
            container.run(inputs)
    for count in (1, 6):
        per_run = []
        for _ in range(runs):
            started = time.perf_counter()
            for container in containers[:count]:
                container.run(inputs)
            per_run.append((time.perf_counter() - started) / count)
        print(
            f"{7 + num_pools} inputs, {count} container(s) in turn: "
            f"median {1e6 * statistics.median(per_run):.1f} us a run ({runs} runs)"
        )


def _check_alike(network: StepNetwork, chunk_layers: int) -> None:
    num_layers = len(network.layers)
    if num_layers % chunk_layers:
        raise SystemExit(f"--chunk-layers {chunk_layers} does not divide the model's {num_layers} layers")
    signatures = {
        tuple((name, tuple(t.shape), t.dtype) for name, t in _constants(layer).items()) for layer in network.layers
    }
    local = {getattr(layer, "local_rope", False) for layer in network.layers}
    if len(signatures) != 1 or len(local) != 1:
        raise SystemExit(
            "the layers differ (formats, shapes or attention kind): one chunk package cannot serve them all"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", type=Path, nargs="?")
    parser.add_argument("--run-cost", action="store_true", help="time one container run of a tiny package, then exit")
    parser.add_argument("--chunk-layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reuse", action="store_true", help="load the packages a previous run left in bench/out")
    parser.add_argument(
        "--compile-unrolled",
        action="store_true",
        help="also compile the unrolled step here, for a same-load comparison",
    )
    args = parser.parse_args()
    if args.run_cost:
        for num_pools in (2, 10):
            container_run_cost(num_pools)
        return
    if args.engine is None:
        parser.error("ENGINE_DIR is needed unless --run-cost")
    eager = Engine.load(args.engine, StepMode.EAGER)  # loads the kernel library; maps the weights
    assert isinstance(eager.backend, NetworkStep)
    network = eager.backend.network
    config = eager.config
    if not config.step_constants_external:
        raise SystemExit("the engine's step package holds its weights (a dense engine): chunks need a weightless one")
    _check_alike(network, args.chunk_layers)

    limits, k = config.limits, args.chunk_layers
    step_args = sample_step_inputs(limits).as_args()
    shapes = dynamic_shapes(limits, 2 * k)
    per_input = shapes[:9]
    pools = kv_pool_views(engine_kv_pool(config.spec, limits, config.kv_dtype))[: 2 * k]
    x = torch.zeros(step_args[0].shape[0], config.spec.hidden_size, dtype=getattr(torch, config.dtype))
    # role -> (package tag: the chunk's names its size, module, sample arguments, dynamic shapes)
    graphs = {
        "embed": ("embed", EmbedGraph(network), (step_args[0],), (per_input[0],)),
        "chunk": (
            f"chunk{k}",
            LayerChunkNetwork(network, 0, k),
            (x, *step_args[1:8], pools),
            (*per_input[:8], [None] * (2 * k)),
        ),
        "head": ("head", HeadNetwork(network), (x, step_args[8]), (per_input[0], per_input[8])),
    }
    packages: dict[str, Path] = {}
    compile_started = time.perf_counter()
    for role, (tag, module, sample, sample_shapes) in graphs.items():
        if args.reuse and (OUT / f"{tag}.pt2").exists():
            packages[role] = OUT / f"{tag}.pt2"
            continue
        packages[role], line = _compile(module, sample, sample_shapes, tag)
        print(line, flush=True)
    built = config.build_info.get("stage_seconds", {}).get("compile", "?")
    print(
        f"three graphs, one after the other: {time.perf_counter() - compile_started:.1f} s "
        f"(the engine's own build: {built} s compile phase)"
    )

    if args.compile_unrolled:
        started = time.perf_counter()
        kv_cache = engine_kv_pool(config.spec, limits, config.kv_dtype)
        compile_cpu_engine(network, limits, kv_cache, OUT / "unrolled.pt2", constants_in_package=False)
        print(f"the unrolled step, export+compile here: {time.perf_counter() - started:.1f} s", flush=True)

    chunked = ChunkedStep(network, packages, k)
    unrolled = Engine.load(args.engine, StepMode.COMPILED)
    pools_chunked = kv_pool_views(engine_kv_pool(config.spec, limits, config.kv_dtype))
    bs, vocab = limits.block_size, config.spec.vocab_size
    steps = [
        [
            RequestSlice([(3 + 11 * i) % vocab for i in range(37)], 0, [0, 1, 2], True),
            RequestSlice([(7 + 13 * i) % vocab for i in range(5)], 0, [10], True),
        ],
        [RequestSlice([(5 + 3 * i) % vocab for i in range(9)], 37, [0, 1, 2], True), RequestSlice([12], 5, [10], True)],
        [RequestSlice([11], 46, [0, 1, 2, 3], True), RequestSlice([13], 6, [10], True)],
    ]
    with torch.inference_mode():
        for index, slices in enumerate(steps):
            inputs = build_step_inputs(slices, bs)
            ours, theirs = chunked(inputs, pools_chunked), unrolled.step(inputs)
            same = torch.equal(ours, theirs)
            print(
                f"step {index}: logits {'bit for bit equal' if same else 'DIFFER'} "
                f"(max |diff| {(ours - theirs).abs().max().item():.3g})",
                flush=True,
            )

        shapes_timed = {
            "decode_b1": (decode_inputs(unrolled, 1), 30),
            "decode_b8": (decode_inputs(unrolled, 8), 30),
            f"prefill_{PREFILL}": (
                build_step_inputs(
                    [RequestSlice([(100 + i) % vocab for i in range(PREFILL)], 0, list(range(PREFILL // bs)), True)], bs
                ),
                5,
            ),
        }
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for name, (inputs, repeats) in shapes_timed.items():
                times.setdefault((name, "unrolled"), []).append(median_ms(lambda i=inputs: unrolled.step(i), repeats))
                times.setdefault((name, "chunked"), []).append(
                    median_ms(lambda i=inputs: chunked(i, pools_chunked), repeats)
                )
    print(f"step time, {args.rounds} rounds alternated (context {CONTEXT} tokens for decode):")
    for name in shapes_timed:
        a, b = statistics.median(times[(name, "unrolled")]), statistics.median(times[(name, "chunked")])
        pairs = zip(times[(name, "unrolled")], times[(name, "chunked")], strict=True)
        rounds = " ".join(f"{u:.1f}/{c:.1f}" for u, c in pairs)
        print(
            f"  {name:12s} unrolled {a:8.2f} ms  chunked ({len(chunked.chunks)} chunks of {k}) {b:8.2f} ms  "
            f"x{b / a:.3f}  rounds (unrolled/chunked): {rounds}"
        )


if __name__ == "__main__":
    main()
