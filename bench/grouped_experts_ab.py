"""Grouped-experts A/B: `ifb_quant::grouped_experts` built from a git revision's plugins/csrc against
the working tree's, on Qwen3-30B-A3B's expert shapes, timed alternately in one run, bits compared.

    .venv/bin/python bench/grouped_experts_ab.py --base HEAD~1 [--rows 1 8 32 512] [--rounds 3] [--threads 2]

Each side runs in its own process (a process loads one kernel library). The experts are random
valid blocks of llama.cpp's Q4_K_M choice for them (gate/up Q4_K, down Q6_K), `--layers` layers of
`--experts` experts each (enough bytes that a call's experts come from memory, not a cache), int8
compute as the engine's default. Every call routes its rows by a fixed random top-8; one timed
sample runs every layer once. Per rows, the min and the median of `--repeats` samples: on a shared
machine the median carries the waits a loaded machine adds, the min the quiet moments.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from kernel_ab import base_sources, run_side_script  # noqa: E402

HIDDEN, INTERMEDIATE, TOP_K = 2048, 768, 8  # Qwen3-30B-A3B

_SIDE = r"""
import json, statistics, sys, time
from pathlib import Path
import torch
sys.path[:0] = [sys.argv[1] + "/tests/unit"]
from quant_cases import random_blocks, random_x
from ifb.plugins import quant_build, quant_ops
from ifb.plugins.grouped_experts import grouped_experts
from ifb.plugins.quant_formats import WeightCompute, WeightFormat

csrc, out = sys.argv[2], sys.argv[3]
hidden, intermediate, top_k, layers, experts, threads, repeats = (int(v) for v in sys.argv[4:11])
row_counts = json.loads(sys.argv[11])
quant_build._CSRC = Path(csrc)
library = quant_build.build_quant_library(Path(out))
quant_build.load_quant_library(library.path, library.required_features)
torch.set_num_threads(threads)
formats = (WeightFormat.Q4_K, WeightFormat.Q6_K)

def stacked(fmt, n, k, seed):
    return torch.stack([quant_ops.pack_int8(random_blocks(n, k, fmt, seed=seed + e), fmt, n, k) for e in range(experts)])

weights = [(stacked(formats[0], 2 * intermediate, hidden, 1000 * layer), stacked(formats[1], hidden, intermediate, 1000 * layer + 500))
           for layer in range(layers)]
results, outputs = {}, []
for rows in row_counts:
    generator = torch.Generator().manual_seed(rows)
    x = random_x(rows, hidden, seed=rows)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(rows)])
    routing = torch.softmax(torch.randn(rows, top_k, generator=generator), dim=-1)
    def call():
        return [grouped_experts(x, ids, routing, up, down, formats, WeightCompute.INT8, intermediate) for up, down in weights]
    outputs.append(call()[0])
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e3)
    results[str(rows)] = {"min": min(samples), "median": statistics.median(samples)}
torch.save(outputs, out + "/outputs.pt")
print(json.dumps(results))
"""


def run_side(csrc: Path, out: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    arguments = [str(ROOT), str(csrc), str(out)]
    arguments += [str(v) for v in (HIDDEN, INTERMEDIATE, TOP_K, args.layers, args.experts, args.threads, args.repeats)]
    return run_side_script(_SIDE, [*arguments, json.dumps(args.rows)])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git revision whose plugins/csrc is the baseline")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=32, help="experts per layer (routing picks among them)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    import os

    import torch

    with tempfile.TemporaryDirectory() as scratch:
        sides = {"base": base_sources(args.base, Path(scratch) / "base"), "tree": ROOT / "plugins" / "csrc"}
        samples: dict[str, dict[str, dict[str, list[float]]]] = {name: {} for name in sides}
        for round_index in range(args.rounds):
            for name, csrc in sides.items():
                out = Path(scratch) / name
                out.mkdir(exist_ok=True)
                times = run_side(csrc, out, args)
                line = ", ".join(f"{rows} rows {t['min']:.2f}/{t['median']:.2f} ms" for rows, t in times.items())
                print(f"round {round_index + 1} {name} (min/median, load {os.getloadavg()[0]:.1f}): {line}")
                for rows, t in times.items():
                    for stat, value in t.items():
                        samples[name].setdefault(rows, {}).setdefault(stat, []).append(value)
        base_outputs, tree_outputs = (torch.load(Path(scratch) / name / "outputs.pt") for name in sides)
        same = all(torch.equal(a, b) for a, b in zip(base_outputs, tree_outputs, strict=True))
    print(f"\n{args.layers} layers x grouped_experts (Q4_K gate/up, Q6_K down, int8), {args.threads} threads")
    print(f"| rows | {args.base} min / median ms | tree min / median ms | tree / base (min, median) |")
    print("| --- | --- | --- | --- |")
    for rows in samples["base"]:
        base, tree = samples["base"][rows], samples["tree"][rows]
        b_min, b_med = min(base["min"]), sorted(base["median"])[len(base["median"]) // 2]
        t_min, t_med = min(tree["min"]), sorted(tree["median"])[len(tree["median"]) // 2]
        print(
            f"| {rows} | {b_min:.2f} / {b_med:.2f} | {t_min:.2f} / {t_med:.2f} | {t_min / b_min:.2f}, {t_med / b_med:.2f} |"
        )
    print(f"\nsame bits: {same}")


if __name__ == "__main__":
    main()
