"""Tile-packing speed per block format: the weight-by-weight packer (old) vs plugins/quant_pack (new).

    .venv/bin/python bench/pack_speed.py                       # random blocks of 1B-shaped tensors
    .venv/bin/python bench/pack_speed.py --gguf FILE.gguf      # every block tensor of a GGUF file
    .venv/bin/python bench/pack_speed.py --gguf FILE.gguf --convert   # + the build's whole pack phase

Per format and layout (exact = `--compute fp32`'s `pack`, int8 = `pack_int8`, what `--compute auto`
picks on AVX2/AVX-512 CPUs) it prints the source MB/s of each packer: wall clock (best of --repeat
for new, one run for old: it takes seconds a tensor) and CPU time of this process (all its threads),
which a machine busy with other work disturbs less. Every packed tensor of the new packer is
compared byte for byte with the old one's (a difference stops the run).

Random blocks: Llama-3.2-1B's shapes (hidden 2048, FFN 8192, 8 KV heads of 64) for the K-quants,
SmolLM2-135M's (hidden 576, FFN 1536: K not a multiple of 256, where llama.cpp's Q4_K_M falls back
to Q5_0 / Q8_0) for the 32-weight formats. --convert also runs builder.build's pack phase
(`_convert`: map, copy out, un-permute, pack, write, reload) on the file with the new packer, first,
so the process's peak RSS it prints is that pack phase's (the bound: the file + 1.5 GB), then with
the old one.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ifb.plugins.quant_formats import GGUF_TYPE_NAMES, WeightFormat, block_bytes, block_weights
from ifb.plugins.quant_pack import pack_tiles
from ifb.plugins.quant_pack_reference import pack_reference

LAYOUTS = {"int8": True, "exact": False}
# format -> [(rows, cols)] of real tensors it holds in a Q4_K_M file
SYNTHETIC = {
    WeightFormat.Q4_K: [(2048, 2048), (512, 2048), (8192, 2048)],  # q, k, gate/up
    WeightFormat.Q6_K: [(512, 2048), (2048, 8192)],  # v, down
    WeightFormat.Q5_K: [(2048, 2048)],  # Q5_K_M's q/o
    WeightFormat.Q5_0: [(1536, 576), (576, 1536)],  # SmolLM2 gate/up, down
    WeightFormat.Q8_0: [(576, 1536), (192, 576)],
    WeightFormat.Q4_0: [(2048, 2048)],
    WeightFormat.Q4_1: [(2048, 2048)],
    WeightFormat.Q5_1: [(2048, 2048)],
}


def synthetic_tensors(seed: int = 0) -> Iterator[tuple[str, WeightFormat, torch.Tensor, int, int]]:
    rng = np.random.default_rng(seed)
    for fmt, shapes in SYNTHETIC.items():
        for n, k in shapes:
            rows = rng.integers(0, 256, (n, k // block_weights(fmt) * block_bytes(fmt)), dtype=np.uint8)
            yield f"{fmt.value} {n}x{k}", fmt, torch.from_numpy(rows), n, k


def gguf_tensors(path: Path) -> Iterator[tuple[str, WeightFormat, torch.Tensor, int, int]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    for tensor in reader.tensors:
        fmt = GGUF_TYPE_NAMES.get(tensor.tensor_type.name)
        if fmt is None or len(tensor.shape) != 2:
            continue
        k, n = int(tensor.shape[0]), int(tensor.shape[1])
        yield tensor.name, fmt, torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True)), n, k


def timed(fn: Callable[[], torch.Tensor], repeat: int) -> tuple[torch.Tensor, float, float]:
    """(result, best wall seconds, CPU seconds of that run)."""
    best_wall, best_cpu, out = float("inf"), float("inf"), None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if wall < best_wall:
            best_wall, best_cpu = wall, cpu
    assert out is not None
    return out, best_wall, best_cpu


def compare(
    tensors: Iterator[tuple[str, WeightFormat, torch.Tensor, int, int]], layouts: list[str], repeat: int
) -> dict[tuple[str, str], list[float]]:
    """(format, layout) -> [bytes, old wall, old cpu, new wall, new cpu]."""
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0] * 5)
    for name, fmt, rows, n, k in tensors:
        for layout in layouts:
            int8 = LAYOUTS[layout]
            old, old_wall, old_cpu = timed(partial(pack_reference, rows, fmt, n, k, int8), 1)
            new, new_wall, new_cpu = timed(partial(pack_tiles, rows, fmt, n, k, int8), repeat)
            if not torch.equal(old, new):
                raise SystemExit(f"{name} {layout}: the new packer's bytes differ from the old one's")
            row = totals[(fmt.value, layout)]
            for i, value in enumerate((rows.numel(), old_wall, old_cpu, new_wall, new_cpu)):
                row[i] += value
    return totals


def table(totals: dict[tuple[str, str], list[float]]) -> str:
    lines = [
        "| format | layout | MB | old MB/s (wall / CPU) | new MB/s (wall / CPU) | speed-up (wall) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    grand = [0.0] * 5
    for (fmt, layout), row in sorted(totals.items()):
        size, old_wall, old_cpu, new_wall, new_cpu = row
        grand = [a + b for a, b in zip(grand, row, strict=True)]
        lines.append(
            f"| {fmt} | {layout} | {size / 1e6:.1f} | {size / old_wall / 1e6:.0f} / {size / old_cpu / 1e6:.0f} | "
            f"{size / new_wall / 1e6:.0f} / {size / new_cpu / 1e6:.0f} | {old_wall / new_wall:.1f}x |"
        )
    size, old_wall, old_cpu, new_wall, new_cpu = grand
    lines.append(
        f"| all | | {size / 1e6:.1f} | {size / old_wall / 1e6:.0f} / {size / old_cpu / 1e6:.0f} | "
        f"{size / new_wall / 1e6:.0f} / {size / new_cpu / 1e6:.0f} | {old_wall / new_wall:.1f}x |"
    )
    return "\n".join(lines)


def convert_phase(path: Path, old: bool) -> str:
    """builder.build's pack phase on `path` in seconds and file MB/s, with the new packer or the old."""
    from ifb.builder.build import BuildOptions, _convert
    from ifb.builder.hf_config import model_spec_from_hf_config
    from ifb.builder.limits import resolve_limits
    from ifb.builder.sources import load_metadata, resolve_source
    from ifb.plugins.quant_formats import WeightCompute
    from ifb.runtime.step import quant_linear

    saved = dict(quant_linear.PACKERS)
    if old:
        quant_linear.PACKERS[WeightCompute.FP32] = partial(_old_packer, int8_layout=False)
        quant_linear.PACKERS[WeightCompute.INT8] = partial(_old_packer, int8_layout=True)

    metadata = load_metadata(resolve_source(str(path)))
    spec = model_spec_from_hf_config(metadata.hf_config)
    options = BuildOptions(max_batch_size=4, max_num_tokens=64, max_seq_len=256, kv_memory_gb=1)
    limits = resolve_limits(
        spec,
        max_batch_size=4,
        max_num_tokens=64,
        max_seq_len=256,
        block_size=options.block_size,
        kv_dtype="float32",
        kv_blocks=None,
        kv_memory_gb=1,
    )
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"pack_speed_{os.getpid()}.weights"
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        _convert(metadata, limits, "float32", options, out)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        out.unlink(missing_ok=True)
        quant_linear.PACKERS.update(saved)
    size = path.stat().st_size
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return (
        f"pack phase (_convert), {'old' if old else 'new'} packer, {path.name} ({size / 1e6:.0f} MB): {wall:.1f} s "
        f"wall, {cpu:.1f} s CPU = {size / wall / 1e6:.0f} MB/s; process peak RSS so far {peak / 2**20:.0f} MiB "
        f"(file {size / 2**20:.0f} MiB)"
    )


def _old_packer(
    blocks: torch.Tensor | list[torch.Tensor], fmt: WeightFormat, n: int, k: int, int8_layout: bool
) -> torch.Tensor:
    """The packer as the build called it before: a fused module's parts concatenated first."""
    rows = blocks if isinstance(blocks, torch.Tensor) else torch.cat(list(blocks))
    return pack_reference(rows, fmt, n, k, int8_layout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="pack this file's block tensors (default: random blocks)")
    parser.add_argument("--layouts", default="int8,exact", help="comma-separated, of int8, exact")
    parser.add_argument("--repeat", type=int, default=3, help="runs of the new packer per tensor (best kept)")
    parser.add_argument(
        "--convert", action="store_true", help="also time the build's pack phase on --gguf, new and old"
    )
    args = parser.parse_args()
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown or args.repeat < 1:
        parser.error(f"--layouts takes {', '.join(LAYOUTS)} (got {', '.join(unknown)}); --repeat >= 1")
    if args.convert and args.gguf is None:
        parser.error("--convert needs --gguf")
    print(f"torch threads {torch.get_num_threads()}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.convert:  # the new packer first: the peak RSS it prints is then the new pack phase's
        print(convert_phase(args.gguf, old=False), flush=True)
        print(convert_phase(args.gguf, old=True), flush=True)
    tensors = gguf_tensors(args.gguf) if args.gguf else synthetic_tensors()
    print(table(compare(tensors, layouts, args.repeat)))
    print(f"load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
