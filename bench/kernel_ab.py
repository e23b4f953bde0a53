"""Kernel A/B: the kernel library built from a git revision's plugins/csrc against the working
tree's, timed alternately in one run on a model's int8 matmul shapes and a causal prefill's
decode attention, and checked for equal bits.

    .venv/bin/python bench/kernel_ab.py --base HEAD~3 [--model smollm2|llama1b] [--rounds 3] [--threads 2] [--rows 200]

Each side runs in its own process (a library is loaded once per process); per shape the median of
`--repeats` calls, per side the best round. With --cpu-time (one thread) the figures are the
calling thread's CPU time, which a neighbour on a shared machine disturbs less than wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# (N, K, format) of each model's linears: fused qkv, o, fused gate/up, down (Llama-3.2-1B as a
# Q4_K_M file holds most of them: Q4_K, with Q6_K for some down projections).
MATMULS = {
    "smollm2": [(960, 576, "Q4_1"), (576, 576, "Q4_1"), (3072, 576, "Q4_1"), (576, 1536, "Q4_1")],
    "llama1b": [(3072, 2048, "Q4_K"), (2048, 2048, "Q4_K"), (16384, 2048, "Q4_K"), (2048, 8192, "Q6_K")],
}

_SIDE = r"""
import json, sys, time
from pathlib import Path
import torch
sys.path[:0] = [sys.argv[1] + "/tests/unit", sys.argv[1] + "/bench"]
from quant_cases import random_blocks, random_x
from quant_kernels import median_ms
from ifb.plugins import quant_build, quant_ops
from ifb.plugins.quant_formats import WeightFormat

csrc, out, rows, threads, repeats, cpu_time = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "1"
quant_build._CSRC = Path(csrc)
library = quant_build.build_quant_library(Path(out))
quant_build.load_quant_library(library.path, library.required_features)
torch.set_num_threads(threads)
clock = time.thread_time if cpu_time else time.perf_counter

results, outputs = {}, []
for n, k, name in json.loads(sys.argv[8]):
    fmt = WeightFormat[name]
    packed = quant_ops.pack_int8(random_blocks(n, k, fmt, seed=n + k), fmt, n, k)
    x = random_x(rows, k, seed=1)
    results[f"int8 {name} {rows}x{n}x{k}"] = median_ms(lambda: quant_ops.quant_linear_int8(x, packed, fmt, n, k), repeats, clock)
    outputs.append(quant_ops.quant_linear_int8(x, packed, fmt, n, k))
generator = torch.Generator().manual_seed(0)
block, heads, kv_heads, dim = 16, 9, 3, 64
q = torch.randn(rows, heads, dim, generator=generator)
pool = [torch.randn(rows + block, kv_heads, dim, generator=generator) for _ in range(2)]
tables = torch.arange((rows + block) // block).repeat(rows, 1)
lengths = torch.arange(1, rows + 1)
attend = lambda: torch.ops.ifb_quant.paged_decode_attention(q, pool[0], pool[1], tables, lengths, block, 0.125)
results[f"attention {rows}-token causal prefill"] = median_ms(attend, repeats, clock)
outputs.append(attend())
torch.save(outputs, out + "/outputs.pt")
print(json.dumps(results))
"""


def base_sources(revision: str, into: Path) -> Path:
    """plugins/csrc as it is at `revision`, extracted under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "plugins/csrc"], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "plugins" / "csrc"


def run_side_script(script: str, arguments: list[str]) -> Any:
    """`script` run in a process of its own (one kernel library per process) with `arguments`;
    the JSON its last line prints."""
    result = subprocess.run([sys.executable, "-c", script, *arguments], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_side(csrc: Path, out: Path, args: argparse.Namespace) -> dict[str, float]:
    arguments = [str(ROOT), str(csrc), str(out), str(args.rows), str(args.threads), str(args.repeats)]
    arguments += ["1" if args.cpu_time else "0", json.dumps(MATMULS[args.model])]
    return run_side_script(_SIDE, arguments)  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git revision whose plugins/csrc is the baseline")
    parser.add_argument("--model", choices=sorted(MATMULS), default="smollm2", help="whose matmul shapes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=200, help="prompt rows per matmul and attention call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--cpu-time", action="store_true", help="thread CPU time (use with --threads 1)")
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as scratch:
        sides = {"base": base_sources(args.base, Path(scratch) / "base"), "tree": ROOT / "plugins" / "csrc"}
        best: dict[str, dict[str, float]] = {}
        for round_index in range(args.rounds):
            for name, csrc in sides.items():
                out = Path(scratch) / name
                out.mkdir(exist_ok=True)
                times = run_side(csrc, out, args)
                print(f"round {round_index + 1} {name}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()))
                best[name] = {k: min(v, best.get(name, {}).get(k, v)) for k, v in times.items()}
        base_outputs, tree_outputs = (torch.load(Path(scratch) / name / "outputs.pt") for name in sides)
        same = all(torch.equal(a, b) for a, b in zip(base_outputs, tree_outputs, strict=True))
    print(f"\n| shape ({args.threads} threads, best round) | {args.base} ms | tree ms | tree / base |")
    print("| --- | --- | --- | --- |")
    for key, base_ms in best["base"].items():
        print(f"| {key} | {base_ms:.3f} | {best['tree'][key]:.3f} | {best['tree'][key] / base_ms:.2f} |")
    print(f"\nsame bits: {same}")


if __name__ == "__main__":
    main()
