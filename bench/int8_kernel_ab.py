"""The int8 block kernel of a git revision against the working tree's, in one process, one thread,
alternated call by call: robust to a busy machine (issue #38).

kernel_ab.py builds the whole library per side and times medians in two processes; on a shared
2-core machine at load 8+ its figures moved 40x between rounds. Here only the torch-free kernel
TU (plugins/csrc/quant_matmul_int8.cpp) is compiled per side, with a small C entry point, both
sides are loaded into this process, and each shape is timed as the fastest of many alternated
calls (a neighbour only ever slows a call down, so the minimum is the undisturbed time). The
outputs of both sides are compared bit for bit, and the rate is set against this machine's
one-thread peak of the ISA's dot instruction (bench/int8_peak.py's loop).

    .venv/bin/python bench/int8_kernel_ab.py --base HEAD [--model smollm2|llama1b] [--rows 512]
        [--isa avx512_vnni|avx512|avx2] [--rounds 20] [--shape N K FORMAT ...]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "unit")]
from int8_peak import measure_int8_peak  # noqa: E402
from kernel_ab import MATMULS, base_sources  # noqa: E402
from quant_cases import random_blocks, random_x  # noqa: E402

from ifb.plugins import quant_ops  # noqa: E402
from ifb.plugins.quant_build import QuantIsa, best_isa, cpu_features, isa_features  # noqa: E402
from ifb.plugins.quant_formats import WeightFormat  # noqa: E402

# The order of plugins/csrc/block_format_table.h: the kernels' Format values.
_FORMAT_ORDER = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
_FLAGS = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl", "avx512_vnni": "-mavx512vnni"}

_ENTRY = r"""
#include <algorithm>
#include <chrono>
#include <vector>
#include "quant_kernels.h"
using namespace ifb_quant;
// Quantizes x, then runs all tiles `calls` times; returns the fastest call in seconds.
extern "C" __attribute__((visibility("default"))) double ifb_int8_time(
    const float* x, long m, long k, const unsigned char* packed, long n, int format, float* y, int calls) {
  const long blocks = k / 32;
  std::vector<int8_t> xq(m * k);
  std::vector<float> scales(m * blocks), scaled(m * blocks);
  std::vector<int32_t> sums(m * blocks), halves(2 * m * blocks);
  const Int8Activations out{xq.data(), k, scales.data(), sums.data(), scaled.data(), halves.data(), blocks};
  quantize_rows_int8(x, k, k, 0, m, out);
  const Int8Problem p{xq.data(), k, scales.data(), sums.data(), scaled.data(), halves.data(), blocks,
                      packed, y, n, m, n, k, static_cast<Format>(format)};
  double best = 1e30;
  for (int i = 0; i < calls; ++i) {
    const auto start = std::chrono::steady_clock::now();
    run_tiles_int8(p, 0, (n + 15) / 16);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}
"""


def build_side(csrc: Path, isa: QuantIsa, out: Path) -> ctypes.CDLL:
    """quant_matmul_int8.cpp of `csrc` plus the timing entry, as one shared library."""
    entry = out / "entry.cpp"
    entry.write_text(_ENTRY)
    flags = [_FLAGS.get(feature, f"-m{feature}") for feature in isa_features(isa)]
    library = out / "int8_side.so"
    command = ["g++", "-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off", *flags]
    command += [f"-I{csrc}", str(csrc / "quant_matmul_int8.cpp"), str(entry), "-o", str(library)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    side = ctypes.CDLL(str(library), mode=ctypes.RTLD_LOCAL)
    side.ifb_int8_time.restype = ctypes.c_double
    side.ifb_int8_time.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long]
    side.ifb_int8_time.argtypes += [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    return side


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git revision whose quant_matmul_int8.cpp is the baseline")
    parser.add_argument("--model", choices=sorted(MATMULS), default="smollm2", help="whose matmul shapes")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--isa", choices=[isa.value for isa in QuantIsa], help="default: this CPU's best path")
    parser.add_argument("--rounds", type=int, default=20, help="alternations; each side 3 calls per round")
    parser.add_argument("--shape", nargs=3, action="append", metavar=("N", "K", "FORMAT"), help="instead of --model's")
    args = parser.parse_args()
    isa = QuantIsa(args.isa) if args.isa else best_isa(cpu_features())
    peak = measure_int8_peak(isa, threads=1)
    print(f"one-thread peak: {peak.macs_per_s / 1e9:.1f} G multiply-adds/s ({peak.instruction}); {isa.value} build")
    with tempfile.TemporaryDirectory(prefix="ifb-int8-ab-") as scratch:
        sides = {}
        for name, csrc in (("base", base_sources(args.base, Path(scratch) / "src")), ("tree", ROOT / "plugins/csrc")):
            (Path(scratch) / name).mkdir()
            sides[name] = build_side(csrc, isa, Path(scratch) / name)
        print(
            f"| {args.rows}-row matmul ({isa.value}, 1 thread) | {args.base} G/s | tree G/s | tree / base "
            "| base share | tree share | same bits |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        shapes = [(int(n), int(k), name) for n, k, name in args.shape] if args.shape else MATMULS[args.model]
        for n, k, name in shapes:
            fmt = WeightFormat[name]
            packed = quant_ops.pack_int8(random_blocks(n, k, fmt, seed=n + k), fmt, n, k).contiguous()
            x = random_x(args.rows, k, seed=1).contiguous()
            ys = {side: torch.empty(args.rows, n) for side in sides}
            best = {side: float("inf") for side in sides}
            for _ in range(args.rounds):
                for side, library in sides.items():
                    seconds = library.ifb_int8_time(
                        x.data_ptr(),
                        args.rows,
                        k,
                        packed.data_ptr(),
                        n,
                        _FORMAT_ORDER.index(name),
                        ys[side].data_ptr(),
                        3,
                    )
                    best[side] = min(best[side], seconds)
            rate = {side: args.rows * n * k / best[side] for side in sides}
            same = torch.equal(ys["base"], ys["tree"])
            print(
                f"| {name} {args.rows}x{n}x{k} | {rate['base'] / 1e9:.1f} | {rate['tree'] / 1e9:.1f} "
                f"| {rate['tree'] / rate['base']:.2f} | {rate['base'] / peak.macs_per_s:.0%} "
                f"| {rate['tree'] / peak.macs_per_s:.0%} | {same} |"
            )


if __name__ == "__main__":
    main()
