"""Time to first token of a long shared prompt, cold vs after a restart with the prefix cache's disk tier.

    .venv/bin/python bench/prefix_disk.py [--engine ENGINE_DIR] [--prompt-tokens 4000] [--repeats 3]

Server 1 (`LLM(engine, prefix_cache_dir=DIR)`, DIR empty) serves the prompt cold and stops, which
writes its cached blocks to DIR; server 2 on the same engine and DIR serves it again: its full
blocks come back from disk and only the last partial block is prefilled. Each server first runs a
short unrelated prompt (less than a block: nothing cached), so neither figure includes the first step's warm-up. TTFT is the time of a
max_tokens=1 request (prefill and one sample). The repeats alternate cold and warm servers, each
cold one on a fresh DIR; the ratio is warm / cold of the medians. Default engine: the bundled
SmolLM2 (built on first use); the prompt is cut to the engine's max_seq_len - 1 if longer.
Prints a table and writes bench/out/prefix_disk.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from ifb import LLM
from ifb.builder.build import BuildOptions
from ifb.find_or_build import find_or_build_engine
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.sampling_params import SamplingParams

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def timed_server(engine: Path, directory: Path, prompt: list[int], warm_up: list[int]) -> dict[str, float]:
    """One server's life: a warm-up request, the timed prompt, a clean stop (the flush is timed too)."""
    llm = LLM(engine, prefix_cache_dir=str(directory))
    try:
        llm.generate(warm_up, FIRST_TOKEN)
        before = llm.stats().kv
        start = time.perf_counter()
        llm.generate(prompt, FIRST_TOKEN)
        ttft = time.perf_counter() - start
        kv = llm.stats().kv
    finally:
        stop = time.perf_counter()
        llm.close()
        close_s = time.perf_counter() - stop
    disk = llm.stats().kv.disk
    return {
        "ttft_s": ttft,
        "prefix_hit_tokens": kv.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens,
        "disk_hit_tokens": kv.disk.hit_tokens - before.disk.hit_tokens,
        "disk_read_bytes": kv.disk.bytes_read - before.disk.bytes_read,
        "disk_written_bytes_at_stop": disk.bytes_written,
        "close_s": close_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=Path, default=None, help="engine folder (default: the bundled SmolLM2)")
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/out/prefix_disk.json"))
    args = parser.parse_args()
    engine = args.engine or find_or_build_engine(None, BuildOptions())
    config = EngineConfig.load(engine, verify=False)
    length = min(args.prompt_tokens, config.limits.max_seq_len - 1)
    rng = random.Random(7)
    vocab = config.spec.vocab_size
    prompt = [rng.randrange(100, vocab) for _ in range(length)]
    warm_up = [rng.randrange(100, vocab) for _ in range(config.limits.block_size // 2)]  # no full block
    runs: list[dict[str, float | str]] = []
    with tempfile.TemporaryDirectory(prefix="ifb-prefix-disk-") as scratch:
        for repeat in range(args.repeats):
            directory = Path(scratch) / f"tier-{repeat}"
            for kind in ("cold", "after_restart"):
                result = timed_server(engine, directory, prompt, warm_up)
                runs.append({"kind": kind, "repeat": repeat, **result})
                print(
                    f"{kind:14s} repeat {repeat}: ttft {result['ttft_s'] * 1e3:8.1f} ms, "
                    f"disk hits {result['disk_hit_tokens']:.0f} tokens, read {result['disk_read_bytes'] / 1e6:.1f} MB, "
                    f"stop {result['close_s']:.2f} s",
                    flush=True,
                )
    cold = statistics.median(float(r["ttft_s"]) for r in runs if r["kind"] == "cold")
    warm = statistics.median(float(r["ttft_s"]) for r in runs if r["kind"] == "after_restart")
    summary = {
        "engine": str(engine),
        "model": config.model_name,
        "prompt_tokens": length,
        "block_size": config.limits.block_size,
        "kv_dtype": config.kv_dtype,
        "cold_ttft_s_median": cold,
        "after_restart_ttft_s_median": warm,
        "ratio": warm / cold,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(
        f"\n{config.model_name}, {length}-token prompt: cold {cold * 1e3:.0f} ms, after a restart "
        f"{warm * 1e3:.0f} ms, ratio {warm / cold:.3f} (medians of {args.repeats})"
    )


if __name__ == "__main__":
    main()
