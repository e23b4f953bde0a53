"""Prompt processing, ifb against llama.cpp on the same GGUF: one 512-token prompt alone (issue #38).

    .venv/bin/python bench/prefill_vs_llama.py [--models smollm2-q4km,1b-q4km] [--gguf FILE ...]
        [--rounds 5] [--repeats 3] [--tokens 512] [--threads 2]

For each file, two sides alternate `--rounds` times in one run:

- llama.cpp: `llama-bench -m FILE -p 512 -n 0 -t 2 -r REPEATS -o json` (pp512: one 512-token
  batch through the model, then its last token's logits), built from the llama-cpp-python sdist
  exactly as bench/peers.py builds llama-server (same flags, same cache under bench/out/llama.cpp);
  its mean tokens/s of the round.
- ifb: the file's engine (`ifb build FILE --max-num-tokens 512` into `--engines`, default
  bench/out/prefill_vs_llama/, built once, default compute), loaded compiled in this process; one step that prefills a
  `--tokens`-token prompt on fresh KV blocks and samples its last row, the median of REPEATS after
  two warm-up steps.

Inputs are bench/gguf_synth.py's (`--models`, made once under bench/out/byo/, llama-quantize from
the same sdist), or any `--gguf`. The table gives each side's tokens/s (median over rounds), the
ratio ifb / llama.cpp with its range over rounds, the kernel ISA ifb built and the load average.
The ratio is #38's "prefill throughput of a 512-token prompt alone" criterion (>= 2.5x).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_synth import ensure_inputs  # noqa: E402
from peers import LLAMA_DIR, OUT, build_llama_server  # noqa: E402
from step import median_ms  # noqa: E402

from ifb.runtime.engine_format import EngineConfig  # noqa: E402
from ifb.runtime.step.backend import StepMode  # noqa: E402
from ifb.runtime.step.engine import Engine  # noqa: E402
from ifb.runtime.step.step_inputs import RequestSlice, StepInputs, build_step_inputs  # noqa: E402

ENGINES = OUT / "prefill_vs_llama"
LLAMA_BENCH = LLAMA_DIR / "bin" / "llama-bench"
TARGETS = ("llama-server", "llama-quantize", "llama-bench")


@dataclass(frozen=True, slots=True)
class Round:
    """One alternation: each side's prompt tokens per second."""

    llama_tps: float
    ifb_tps: float


def ensure_engine(gguf: Path, tokens: int, engines: Path) -> Path:
    """The ifb engine of `gguf` under `engines` with room for one `tokens`-token step (built once, kept)."""
    folder = engines / gguf.stem
    if (folder / "engine.json").is_file():
        return folder
    engines.mkdir(parents=True, exist_ok=True)
    ifb = Path(sys.executable).with_name("ifb")
    command = [str(ifb), "build", str(gguf), "-o", str(folder), "--max-num-tokens", str(max(tokens, 512))]
    print(f"building {folder}: {' '.join(command)}", flush=True)
    subprocess.run(command, check=True)
    return folder


def prefill_inputs(engine: Engine, tokens: int) -> StepInputs:
    """One prompt of `tokens` distinct-ish ids from position 0, on blocks 0.., its last row sampled."""
    block_size = engine.config.limits.block_size
    vocab = engine.config.spec.vocab_size
    ids = [(100 + 7 * i) % vocab for i in range(tokens)]
    blocks = list(range(-(-tokens // block_size)))
    return build_step_inputs([RequestSlice(ids, 0, blocks, True)], block_size)


def ifb_tokens_per_s(engine: Engine, inputs: StepInputs, tokens: int, repeats: int) -> float:
    return tokens / (median_ms(lambda: engine.step(inputs), repeats) / 1000)  # (two warm-up steps first)


def llama_tokens_per_s(gguf: Path, tokens: int, repeats: int, threads: int) -> float:
    command = [str(LLAMA_BENCH), "-m", str(gguf), "-p", str(tokens), "-n", "0", "-t", str(threads)]
    command += ["-r", str(repeats), "-o", "json"]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    rows = [row for row in json.loads(done.stdout) if row.get("n_prompt") == tokens and row.get("n_gen") == 0]
    if len(rows) != 1:
        raise SystemExit(f"llama-bench printed no single pp{tokens} row: {done.stdout[:400]}")
    return float(rows[0]["avg_ts"])


def measure(gguf: Path, args: argparse.Namespace) -> dict[str, object]:
    folder = ensure_engine(gguf, args.tokens, args.engines)
    engine = Engine.load(folder, StepMode.COMPILED)
    inputs = prefill_inputs(engine, args.tokens)
    rounds = []
    for index in range(args.rounds):
        llama = llama_tokens_per_s(gguf, args.tokens, args.repeats, args.threads)
        ifb = ifb_tokens_per_s(engine, inputs, args.tokens, args.repeats)
        rounds.append(Round(llama, ifb))
        print(f"  {gguf.name} round {index + 1}: llama.cpp {llama:.1f} tok/s, ifb {ifb:.1f} tok/s", flush=True)
    config = EngineConfig.load(folder)
    ratios = [r.ifb_tps / r.llama_tps for r in rounds]
    return {
        "file": str(gguf),
        "file_mb": round(gguf.stat().st_size / 1e6, 1),
        "engine": str(folder),
        "kernel_isa": config.kernels.isa if config.kernels else "none",
        "compute": config.weight_compute.value,
        "llama_tps": statistics.median(r.llama_tps for r in rounds),
        "ifb_tps": statistics.median(r.ifb_tps for r in rounds),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rounds": [{"llama_tps": r.llama_tps, "ifb_tps": r.ifb_tps} for r in rounds],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-q4km,1b-q4km", help="bench/gguf_synth.py keys ('' for none)")
    parser.add_argument("--gguf", type=Path, action="append", default=[], help="another file, repeatable")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engines", type=Path, default=ENGINES, help="where each file's engine is built and kept")
    parser.add_argument("--out", type=Path, default=OUT / "prefill_vs_llama.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    build = build_llama_server(args.threads, False, TARGETS)
    keys = [key for key in args.models.split(",") if key]
    files = [*ensure_inputs(keys, args.threads).values(), *args.gguf] if keys else list(args.gguf)
    load_before = os.getloadavg()[0]
    rows = [measure(gguf, args) for gguf in files]
    load_after = os.getloadavg()[0]
    print(f"\n{platform.processor() or platform.machine()}, {args.threads} threads, llama.cpp {build.get('version')}")
    print(f"load average {load_before:.1f} -> {load_after:.1f}; {args.rounds} alternated rounds, medians")
    print(f"| file | ifb kernels (compute) | llama.cpp pp{args.tokens} tok/s | ifb tok/s | ifb / llama.cpp (range) |")
    print("| --- | --- | ---: | ---: | --- |")
    for row in rows:
        print(
            f"| {Path(str(row['file'])).name} ({row['file_mb']} MB) | {row['kernel_isa']} ({row['compute']}) "
            f"| {row['llama_tps']:.1f} | {row['ifb_tps']:.1f} | **{row['ratio_median']:.2f}x** "
            f"({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"llama_cpp": build, "load": [load_before, load_after], "threads": args.threads, "rows": rows}
    args.out.write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()
