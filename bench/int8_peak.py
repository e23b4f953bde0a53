"""This machine's int8 multiply-add peak: a tight loop of the ISA's dot instruction on every thread,
and the engine's int8 block kernel at 512 rows as a fraction of it (issue #38).

The peak is what the instruction can do with its operands in registers: on AVX-512 VNNI one
`vpdpbusd` (64 u8 x s8 multiply-adds into 16 int32) per accumulator, on AVX2 and AVX-512 without
VNNI the `vpmaddubsw` + `vpmaddwd` + `vpaddd` sequence the kernels use instead (32 or 64
multiply-adds per three instructions). Twelve independent accumulators cover the instruction's
latency. The loop is compiled here with the same flags as the kernel library's ISA path
(plugins/quant_build.py), one OpenMP thread per torch thread. AMX tiles (`tdpbusd`) are not
measured: the kernels do not use them. `measure_fp32_peak` runs the same loop on `vfmadd231ps`, the
fp32 FMA the attention kernels are made of (bench/prefill_attention.py --peaks prices attention
with it).

    .venv/bin/python bench/int8_peak.py [--rows 512] [--shapes smollm2|llama1b]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "unit")]
from kernel_ab import MATMULS  # noqa: E402  (the models' matmul shapes and formats)
from quant_cases import random_blocks, random_x  # noqa: E402

from ifb.plugins.quant_build import QuantIsa, best_isa, cpu_features, isa_features  # noqa: E402

_LOOP = r"""
#include <immintrin.h>
#include <omp.h>
#define ACC 12
extern "C" long long dot_loop(long long iters, int threads) {
  long long total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    VEC a = SET1(1 + omp_get_thread_num()), b = SET1(3);
    VEC acc[ACC];
    for (int k = 0; k < ACC; ++k) acc[k] = ZERO();
    for (long long i = 0; i < iters; ++i) {
      // opaque to the optimizer each iteration; and the maddubs paths multiply the accumulator's
      // own bytes: with loop-invariant operands their maddubs/madd were computed once and only
      // the adds were timed (903 G/s "on AVX-512", above the VNNI loop)
      __asm__ volatile("" : "+v"(a), "+v"(b));
#pragma GCC unroll 12
      for (int k = 0; k < ACC; ++k) acc[k] = DOT(acc[k], a, b);
    }
    VEC sum = acc[0];
    for (int k = 1; k < ACC; ++k) sum = ADD(sum, acc[k]);
    alignas(64) int lanes[sizeof(VEC) / 4];
    STORE((VEC*)lanes, sum);
    total += lanes[0];
  }
  return total;
}
"""
# (macros, multiply-adds per DOT per accumulator, what it runs)
_VARIANTS: dict[QuantIsa, tuple[str, int, str]] = {
    QuantIsa.AVX512_VNNI: (
        "#define VEC __m512i\n#define SET1 _mm512_set1_epi8\n#define ZERO _mm512_setzero_si512\n"
        "#define ADD _mm512_add_epi32\n#define STORE _mm512_store_si512\n"
        "#define DOT(c, a, b) _mm512_dpbusd_epi32(c, a, b)\n",
        64,
        "vpdpbusd zmm",
    ),
    QuantIsa.AVX512: (
        "#define VEC __m512i\n#define SET1 _mm512_set1_epi8\n#define ZERO _mm512_setzero_si512\n"
        "#define ADD _mm512_add_epi32\n#define STORE _mm512_store_si512\n"
        "#define DOT(c, a, b) _mm512_add_epi32(c, _mm512_madd_epi16(_mm512_maddubs_epi16(c, b), _mm512_set1_epi16(1)))\n",
        64,
        "vpmaddubsw+vpmaddwd+vpaddd zmm",
    ),
    QuantIsa.AVX2: (
        "#define VEC __m256i\n#define SET1 _mm256_set1_epi8\n#define ZERO _mm256_setzero_si256\n"
        "#define ADD _mm256_add_epi32\n#define STORE(p, v) _mm256_store_si256(p, v)\n"
        "#define DOT(c, a, b) _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(c, b), _mm256_set1_epi16(1)))\n",
        32,
        "vpmaddubsw+vpmaddwd+vpaddd ymm",
    ),
}
# The fp32 FMA loop each path's attention kernel runs on (plugins/csrc/simd16.h: one zmm, or two
# ymm, per 16 lanes): its peak bounds what fp32 attention can cost (bench/prefill_attention.py).
_FP32_VARIANTS: dict[QuantIsa, tuple[str, int, str]] = {
    isa: (
        f"#define VEC __m{bits}\n#define SET1 _mm{bits}_set1_ps\n#define ZERO _mm{bits}_setzero_ps\n"
        f"#define ADD _mm{bits}_add_ps\n#define STORE(p, v) _mm{bits}_store_ps((float*)(p), v)\n"
        f"#define DOT(c, a, b) _mm{bits}_fmadd_ps(a, b, c)\n",
        bits // 32,
        f"vfmadd231ps {'zmm' if bits == 512 else 'ymm'}",
    )
    for isa, bits in ((QuantIsa.AVX512_VNNI, 512), (QuantIsa.AVX512, 512), (QuantIsa.AVX2, 256))
}
_FLAGS = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl", "avx512_vnni": "-mavx512vnni"}
_ACCUMULATORS = 12


@dataclass(frozen=True, slots=True)
class Peak:
    """A loop's multiply-adds per second on one ISA path's vectors, with its instruction and threads."""

    isa: QuantIsa
    instruction: str
    threads: int
    macs_per_s: float


def _compile(isa: QuantIsa, macros: str, folder: Path) -> ctypes.CDLL:
    source = folder / "dot_loop.cpp"
    source.write_text(macros + _LOOP)
    library = folder / "dot_loop.so"
    flags = [_FLAGS.get(feature, f"-m{feature}") for feature in isa_features(isa)]
    command = ["g++", "-O2", "-shared", "-fPIC", "-fopenmp", *flags, str(source), "-o", str(library)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    loop = ctypes.CDLL(str(library))
    loop.dot_loop.restype = ctypes.c_longlong
    loop.dot_loop.argtypes = [ctypes.c_longlong, ctypes.c_int]
    return loop


def measure_int8_peak(isa: QuantIsa | None = None, threads: int | None = None, repeats: int = 50) -> Peak:
    """The fastest of `repeats` timed loops (noise from other work only slows a loop down)."""
    chosen = isa or best_isa(cpu_features())
    return _measure_peak(chosen, _VARIANTS[chosen], threads, repeats)


def measure_fp32_peak(isa: QuantIsa | None = None, threads: int | None = None, repeats: int = 50) -> Peak:
    """The fp32 FMA loop's peak on the path's vectors, measured as the int8 one is."""
    chosen = isa or best_isa(cpu_features())
    return _measure_peak(chosen, _FP32_VARIANTS[chosen], threads, repeats)


def _measure_peak(chosen: QuantIsa, variant: tuple[str, int, str], threads: int | None, repeats: int) -> Peak:
    threads = threads or torch.get_num_threads()
    macros, macs_per_dot, instruction = variant
    iterations = 100_000  # ~2 ms a loop: short, like one kernel call, so both catch the quiet moments of a busy machine
    with tempfile.TemporaryDirectory(prefix="ifb-peak-") as scratch:
        loop = _compile(chosen, macros, Path(scratch))
        loop.dot_loop(10_000, threads)  # threads started, clocks up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            loop.dot_loop(iterations, threads)
            best = min(best, time.perf_counter() - start)
    macs = iterations * _ACCUMULATORS * macs_per_dot * threads
    return Peak(chosen, instruction, threads, macs / best)


def kernel_macs_per_s(rows: int, n: int, k: int, type_name: str, repeats: int = 50) -> float:
    """The engine's int8 block kernel on one matmul (rows x k activations, n x k random valid blocks)."""
    from ifb.plugins import quant_ops
    from ifb.plugins.quant_formats import WeightFormat

    fmt = WeightFormat[type_name]
    packed = quant_ops.pack_int8(random_blocks(n, k, fmt, seed=n + k), fmt, n, k)
    x = random_x(rows, k, seed=1)
    quant_ops.quant_linear_int8(x, packed, fmt, n, k)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        quant_ops.quant_linear_int8(x, packed, fmt, n, k)
        best = min(best, time.perf_counter() - start)
    return rows * n * k / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512, help="activation rows: a 512-token prefill")
    parser.add_argument("--shapes", choices=sorted(MATMULS), default="smollm2")
    args = parser.parse_args()
    from ifb.builder.artifact_cache import ArtifactCache
    from ifb.builder.compile_cpu import build_engine_kernels

    with tempfile.TemporaryDirectory(prefix="ifb-int8-kernels-") as scratch:
        build_engine_kernels(Path(scratch), ArtifactCache())  # the kernel library for this CPU, loaded here
        peak = measure_int8_peak()
        for (
            other
        ) in QuantIsa:  # the other paths this CPU runs: what an AVX2 or AVX-512 machine's loop could do per clock
            if other is not peak.isa and set(isa_features(other)) <= cpu_features():
                slower = measure_int8_peak(other)
                print(f"  ({other.value} path: {slower.macs_per_s / 1e9:.1f} G/s with {slower.instruction})")
        print(f"int8 peak: {peak.macs_per_s / 1e9:.1f} G multiply-adds/s ({peak.instruction}, {peak.threads} threads)")
        for n, k, type_name in MATMULS[args.shapes]:
            rate = kernel_macs_per_s(args.rows, n, k, type_name)
            print(
                f"  {type_name} {args.rows}x{n}x{k}: {rate / 1e9:6.1f} G/s = {rate / peak.macs_per_s:5.1%} of the peak"
            )


if __name__ == "__main__":
    main()
