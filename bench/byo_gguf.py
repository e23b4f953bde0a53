"""Bring your own GGUF: build and serve a user's Q4_K_M / Q4_0 files, against llama.cpp on the same files.

    .venv/bin/python bench/byo_gguf.py [--models smollm2-q4km,1b-q4km,1b-q4_0,8b-q4km]
        [--compute default,int8] [--clients 16] [--prompt-tokens 256] [--max-tokens 128]
        [--rss-cap-gb 22] [--ifb-rev HEAD | --ifb-tree DIR] [--label NAME] [--skip-serve] [--rebuild] [--merge]
    .venv/bin/python bench/byo_gguf.py --report      # print the table of bench/out/byo_gguf.json again

Inputs (bench/gguf_synth.py, made here, no weights downloaded, cached in bench/out/byo/):
smollm2-q4km = the bundled SmolLM2-135M requantized to Q4_K_M by llama-quantize; 1b-q4km / 1b-q4_0 =
a random-weight Llama-3.2-1B-shaped model quantized from F16; 8b-q4km = Llama-3.1-8B-shaped, Q4_K_M.

For each model and each --compute value ("default" = no --compute flag):
  1. `ifb build GGUF -o bench/out/byo/engines/MODEL-COMPUTE --max-batch-size 16 --kv-blocks N` in its own
     process group: wall time, peak RSS of the process tree (psutil, every 0.2 s) and the build process's
     own ru_maxrss (wait4), exit code, engine folder size. Killed (and recorded so) when the tree's RSS
     passes --rss-cap-gb or the machine's available memory drops under --min-available-gb (1), so an
     out-of-memory build cannot take the shared machine down; the harness goes on with the next one.
  2. llama-server (`-np CLIENTS -t 2 -c CLIENTS*(PROMPT+MAX+MARGIN)`) and `ifb run ENGINE --threads 2`,
     one at a time, with bench/peers.py's client and measurement (peers.measure): resident memory after
     the 2-request warm-up (RSS, of it anonymous) and its peak over the run; (a) single stream, sequential
     requests; (b) CLIENTS concurrent streaming clients. Same prompts, same request body. ifb's KV pool
     holds the same tokens as llama-server's context (N = CLIENTS * ceil((PROMPT+MAX+MARGIN)/16) blocks).
Prints one table and writes bench/out/byo_gguf.json (with the CPU's ISA flags and engine.json's kernel ISA).

--ifb-rev REV measures a committed builder: `git archive REV` is unpacked under bench/out/byo/trees/ and
ifb is run from it (the shared working tree may be mid-edit). Default: the installed `ifb`. --label NAME
names the engine folders and table rows (MODEL-COMPUTE-NAME, "COMPUTE@NAME"), so with --merge one JSON
holds builds of several builder commits; a build with a record under bench/out/byo/engines/ is reused
unless --rebuild (or --retry-failed for failed ones).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402
from gguf_synth import BYO, MODELS, ROOT, ensure_inputs, tensor_types  # noqa: E402

ENGINES = BYO / "engines"
RESULTS = peers.OUT / "byo_gguf.json"
BLOCK = 16

# Runs `ifb` from another source tree than the editable install's (argv: TREE, ifb arguments).
TREE_LAUNCHER = """
import importlib.util, sys
from pathlib import Path
import os
# A spawned child (the builder compiles in one) runs this file again with the parent's sys.argv:
# the tree comes to it through the environment.
tree = Path(os.environ.setdefault("IFB_BENCH_TREE", str(Path(sys.argv[1]).resolve())))
dirs = {"ifb": "ifb", "ifb.builder": "builder", "ifb.cli": "cli", "ifb.plugins": "plugins", "ifb.runtime": "runtime"}
class TreeFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name in dirs:
            d = tree / dirs[name]
            return importlib.util.spec_from_file_location(name, d / "__init__.py", submodule_search_locations=[str(d)])
        return None
sys.meta_path.insert(0, TreeFinder)
if __name__ == "__main__":  # not in a spawned child (the builder compiles in one), which imports this file
    sys.argv = ["ifb", *sys.argv[2:]]
    from ifb.cli.main import cli
    cli()
"""

ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")  # fmt: skip


def cpu_isa() -> dict[str, Any]:
    flags: set[str] = set()
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
        if line.startswith("model name") and not model:
            model = line.split(":", 1)[1].strip()
    present = [f for f in ISA_FLAGS if f in flags]
    return {"model_name": model, "flags": present, "summary": " ".join(present) or "none of " + ",".join(ISA_FLAGS)}


# ---------------------------------------------------------------------------------------------
# ifb command
# ---------------------------------------------------------------------------------------------


def ifb_command(args) -> tuple[list[str], str]:
    """The argv prefix that runs ifb, and a description of which source tree it runs."""
    tree = None
    if args.ifb_rev:
        sha = subprocess.run(["git", "rev-parse", args.ifb_rev], cwd=ROOT, capture_output=True, text=True, check=True)
        sha = sha.stdout.strip()
        tree = BYO / "trees" / sha[:12]
        if not (tree / "builder" / "__init__.py").is_file():
            tree.mkdir(parents=True, exist_ok=True)
            archive = subprocess.Popen(["git", "archive", sha], cwd=ROOT, stdout=subprocess.PIPE)
            subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
            archive.wait()
        desc = f"git archive {args.ifb_rev} ({sha[:12]}) at {tree.relative_to(ROOT)}"
    elif args.ifb_tree:
        tree = Path(args.ifb_tree).resolve()
        desc = f"source tree {tree}"
    if tree is not None:
        launcher = BYO / "ifb_tree.py"
        launcher.write_text(TREE_LAUNCHER)
        return [sys.executable, str(launcher), str(tree)], desc
    exe = Path(sys.executable).parent / "ifb"
    status = subprocess.run(["git", "status", "--porcelain", "--", "builder", "runtime", "plugins", "cli", "ifb"],
                            cwd=ROOT, capture_output=True, text=True).stdout  # fmt: skip
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = f", {len(status.splitlines())} uncommitted file(s) under builder/runtime/plugins/cli/ifb" if status else ""
    return (
        [str(exe)] if exe.is_file() else [sys.executable, "-m", "ifb.cli.main"]
    ), f"installed ifb (HEAD {head.strip()}{dirty})"


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------


def tree_memory(pid: int) -> dict[str, float]:
    """RSS and anonymous RSS (RSS minus file-backed/shared pages) of a process and its descendants, bytes."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {"rss": 0.0, "anon": 0.0, "processes": 0}
    rss = anon = 0.0
    n = 0
    for p in procs:
        try:
            mi = p.memory_info()
        except psutil.Error:
            continue
        rss += mi.rss
        anon += mi.rss - getattr(mi, "shared", 0)
        n += 1
    return {"rss": rss, "anon": anon, "processes": n}


class PeakPoller:
    """Polls a process tree's RSS until stopped or the process is gone; keeps the peak."""

    def __init__(self, pid: int, interval: float = 0.2, cap_bytes: float | None = None, on_cap=None,
                 min_available_bytes: float | None = None):  # fmt: skip
        self.pid, self.interval, self.cap, self.on_cap = pid, interval, cap_bytes, on_cap
        self.min_available = min_available_bytes
        self.peak = {"rss": 0.0, "anon": 0.0}
        self.capped = False
        self.cap_reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and psutil.pid_exists(self.pid):
            m = tree_memory(self.pid)
            for k in self.peak:
                self.peak[k] = max(self.peak[k], m[k])
            reason = None
            if self.cap is not None and m["rss"] > self.cap:
                reason = f"tree RSS {m['rss'] / 1e9:.1f} GB > cap {self.cap / 1e9:.1f} GB"
            elif self.min_available is not None and (avail := psutil.virtual_memory().available) < self.min_available:
                reason = f"machine's available memory {avail / 1e9:.1f} GB < {self.min_available / 1e9:.1f} GB (tree RSS {m['rss'] / 1e9:.1f} GB)"
            if reason and not self.capped:
                self.capped, self.cap_reason = True, reason
                if self.on_cap is not None:
                    self.on_cap()
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(5)
        return dict(self.peak)


def gb(x: float | None) -> float | None:
    return None if x is None else round(x / 1e9, 3)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------


def engine_summary(out: Path) -> dict[str, Any]:
    """What engine.json says the builder made: dtypes, compute mode, block formats, kernel ISA, stage times."""
    cfg = json.loads((out / "engine.json").read_text())
    keys = ("dtype", "kv_dtype", "weight_compute", "weight_formats", "backend", "build_options", "build")
    summary = {k: cfg.get(k) for k in keys}
    summary["kernel_isa"] = (cfg.get("kernels") or {}).get("isa")
    return summary


def build_engine(ifb_cmd: list[str], gguf: Path, out: Path, compute: str, args) -> dict[str, Any]:
    record_path = out.with_name(out.name + ".build.json")
    if record_path.is_file() and not args.rebuild:
        rec = json.loads(record_path.read_text())
        if rec.get("ok") or not args.retry_failed:
            rec["cached"] = True
            if rec.get("ok") and (out / "engine.json").is_file():
                rec["engine_json"] = engine_summary(out)
            print(
                f"[build {out.name}] cached record ({'ok' if rec.get('ok') else 'FAILED'}): {record_path.name}",
                flush=True,
            )
            return rec
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    per_seq = args.prompt_tokens + args.max_tokens + args.ctx_margin
    kv_blocks = args.clients * math.ceil(per_seq / BLOCK)
    cmd = [*ifb_cmd, "build", str(gguf), "-o", str(out), "--max-batch-size", str(args.max_batch_size),
           "--kv-blocks", str(kv_blocks), *(["--compute", compute] if compute != "default" else []),
           *shlex.split(args.build_args)]  # fmt: skip
    log = out.with_name(out.name + ".build.log")
    print(f"[build {out.name}] $ {shlex.join(cmd)}  (log: {log.relative_to(ROOT)})", flush=True)
    cap = args.rss_cap_gb * 1e9
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if args.build_threads_env else None
    load_before = peers.loadavg()
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def kill_group() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    poller = PeakPoller(proc.pid, cap_bytes=cap, on_cap=kill_group, min_available_bytes=args.min_available_gb * 1e9)
    timed_out = False
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            break
        if time.perf_counter() - t0 > args.build_timeout and not timed_out:
            timed_out = True
            kill_group()
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    kill_group()  # leftovers (compiler children) of a killed build
    peak = poller.stop()
    ok = proc.returncode == 0 and (out / "engine.json").is_file()
    rec: dict[str, Any] = {
        "command": shlex.join(cmd),
        "log": str(log.relative_to(ROOT)),
        "ok": ok,
        "exit_code": proc.returncode,
        "killed_at_rss_cap": poller.capped,
        "kill_reason": poller.cap_reason,
        "rss_cap_gb": args.rss_cap_gb,
        "timed_out": timed_out,
        "wall_s": round(wall, 1),
        "peak_tree_rss_gb": gb(peak["rss"]),
        "peak_tree_anon_gb": gb(peak["anon"]),
        "ru_maxrss_gb": round(ru.ru_maxrss * 1024 / 1e9, 3),  # largest single process (KiB on Linux)
        "kv_blocks": kv_blocks,
        "load_before": load_before,
        "cached": False,
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    if ok:
        rec["engine_bytes"] = folder_bytes(out)
        rec["engine_files"] = {
            str(f.relative_to(out)): f.stat().st_size
            for f in sorted(out.rglob("*"))
            if f.is_file() and f.stat().st_size > 1 << 20
        }
        rec["engine_json"] = engine_summary(out)
    else:
        rec["log_tail"] = log.read_text(errors="replace")[-2000:]
    what = (
        "ok"
        if ok
        else (
            f"KILLED ({poller.cap_reason})"
            if poller.capped
            else "TIMED OUT"
            if timed_out
            else f"FAILED rc={proc.returncode}"
        )
    )
    print(f"[build {out.name}] {what}: {wall:.0f} s, peak RSS {rec['peak_tree_rss_gb']} GB (tree), "
          f"{rec['ru_maxrss_gb']} GB (ru_maxrss)" + (f", engine {rec['engine_bytes'] / 1e9:.2f} GB" if ok else ""),
          flush=True)  # fmt: skip
    record_path.write_text(json.dumps(rec, indent=2))
    return rec


# ---------------------------------------------------------------------------------------------
# serve
# ---------------------------------------------------------------------------------------------


def wait_for_cost_model(server: peers.Server, timeout_s: float = 1800.0) -> dict[str, Any]:
    """An ifb engine built `--calibration serve` times its steps in idle turns after it is up: wait for
    that before measuring, so the runs see the fitted step budget (and no calibration steps between
    requests). llama-server has no such field; nothing to wait for."""
    t0 = time.perf_counter()
    source = None
    while time.perf_counter() - t0 < timeout_s:
        try:
            body = httpx.get(server.url + "/health", timeout=30).json()
        except (httpx.HTTPError, ValueError):
            return {}
        source = (body.get("step_budget") or {}).get("cost_model_source")
        if source != "pending":
            break
        time.sleep(2.0)
    waited = time.perf_counter() - t0
    if source is not None:
        print(f"[{server.name}] step cost model: {source} (waited {waited:.0f} s)", flush=True)
    return {"cost_model_source": source, "calibration_wait_s": round(waited, 1)}


def serve(server: peers.Server, args, prompts) -> dict[str, Any]:
    """peers.measure plus resident memory after warm-up and its peak until the server stops."""
    state: dict[str, Any] = {}

    def on_warm(s: peers.Server) -> dict[str, Any]:
        calibration = wait_for_cost_model(s)
        m = tree_memory(s.proc.pid)
        state["poller"] = PeakPoller(s.proc.pid, interval=0.5)
        print(f"[{s.name}] after warm-up: RSS {m['rss'] / 1e9:.2f} GB (anonymous {m['anon'] / 1e9:.2f} GB)", flush=True)
        return {"rss_gb": gb(m["rss"]), "anon_gb": gb(m["anon"]), "processes": m["processes"], **calibration}

    try:
        result = peers.measure(server, args, prompts, args.start_timeout, on_warm=on_warm)
        result["ok"] = True
    except SystemExit as exc:  # peers raises SystemExit on a failed start or failed requests
        server.stop()
        result = {"ok": False, "error": str(exc), "command": shlex.join(server.cmd)}
        print(f"[{server.name}] FAILED: {exc}", flush=True)
    if "poller" in state:
        peak = state["poller"].stop()
        result["peak_during_run"] = {"rss_gb": gb(peak["rss"]), "anon_gb": gb(peak["anon"])}
    return result


def make_prompts(tokenizer_folder: Path, args) -> dict[str, list[str]]:
    """Warm-up, single-stream and concurrent prompts of --prompt-tokens by `tokenizer_folder`'s tokenizer."""
    n_single = args.single_requests
    all_prompts = peers.make_prompts(tokenizer_folder, 2 + n_single + args.clients, args.prompt_tokens, args.seed)
    return {
        "warmup": all_prompts[:2],
        "single": all_prompts[2 : 2 + n_single],
        "concurrent": all_prompts[2 + n_single :],
    }


def tokenizer_dir() -> Path:
    """A folder with tokenizer/tokenizer.json for peers.make_prompts: SmolLM2's, which every input but
    the mixtures of experts (bench/moe_synth.py: a synthetic vocabulary of the real size) uses."""
    folder = BYO / "prompt-tokenizer"
    if not (folder / "tokenizer" / "tokenizer.json").is_file():
        from gguf_synth import bundled_gguf
        from transformers import AutoTokenizer

        src = bundled_gguf()
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        tok.save_pretrained(str(folder / "tokenizer"))
    return folder


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def fmt(x: Any, spec: str = ".1f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def ratio(a: Any, b: Any) -> str:
    return f" ({a / b:.2f}x)" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else ""


def serve_numbers(r: dict[str, Any] | None) -> dict[str, Any]:
    if not r or not r.get("ok"):
        return {}
    c = r["concurrent"]
    return {
        "rss": (r.get("after_warmup") or {}).get("rss_gb"),
        "anon": (r.get("after_warmup") or {}).get("anon_gb"),
        "single": r["single"]["decode_tok_s_mean"],
        "single_ttft": r["single"]["ttft_mean_s"] * 1000,
        "conc": c["output_tok_s"],
        "ttft50": c["ttft_p50_s"],
        "ttft99": c["ttft_p99_s"],
        "itl50": c["itl_p50_s"] * 1000,
        "itl99": c["itl_p99_s"] * 1000,
    }


def engine_desc(build: dict[str, Any] | None) -> str:
    """' [compute; formats]' of a built engine, e.g. ' [int8; q4_0 ×112, lm_head q8_0, rest fp32]'."""
    ej = (build or {}).get("engine_json") if (build or {}).get("ok") else None
    if not ej:
        return ""
    formats = ej.get("weight_formats") or {}
    counts = Counter(v for k, v in formats.items() if k != "lm_head")
    parts = [f"{f} ×{n}" for f, n in counts.most_common()]
    if "lm_head" in formats:
        parts.append(f"head {formats['lm_head']}")
    parts.append("rest fp32" if formats else "all fp32")
    return f" [{ej.get('weight_compute')}, {ej.get('dtype')}; {', '.join(parts)}]"


def table(results: dict[str, Any], clients: int) -> str:
    head = ("| model (file) | server | build s | build peak RSS GB | engine GB | RSS warm GB (anon) | 1 stream tok/s "
            f"| 1 stream TTFT ms | {clients} clients tok/s | TTFT p50 / p99 s | ITL p50 / p99 ms |")  # fmt: skip
    lines = [head, "|" + " --- |" * 11]
    for model, m in results.items():
        types = ", ".join(f"{k}×{v}" for k, v in m["tensor_types"].items())
        file_desc = f"{model} ({m['file_mb']:,.0f} MB: {types})"
        llama = serve_numbers(m.get("llama"))
        rows = [("llama-server", None, llama, None)]
        for compute, e in m.get("ifb", {}).items():
            rows.append(
                (f"ifb {compute}{engine_desc(e.get('build'))}", e.get("build"), serve_numbers(e.get("serve")), e)
            )
        for i, (name, build, s, e) in enumerate(rows):
            if build is None:
                bcols = ["—", "—", "—"]
                if name == "llama-server" and m.get("llama") and not m["llama"].get("ok"):
                    name += " (FAILED)"
            elif not build.get("ok"):
                why = (
                    "killed: " + str(build.get("kill_reason") or "RSS cap")
                    if build.get("killed_at_rss_cap")
                    else "timeout"
                    if build.get("timed_out")
                    else f"rc {build.get('exit_code')}"
                )
                bcols = [f"{fmt(build['wall_s'], '.0f')} FAILED ({why})", fmt(build.get("peak_tree_rss_gb")), "—"]
            else:
                bcols = [
                    fmt(build["wall_s"], ".0f"),
                    fmt(build.get("peak_tree_rss_gb")),
                    fmt(build["engine_bytes"] / 1e9, ".2f"),
                ]
            if e is not None and e.get("serve") and not e["serve"].get("ok"):
                name += " (serve FAILED)"
            base = llama if i > 0 else {}
            cells = [
                file_desc if i == 0 else "",
                name,
                *bcols,
                (f"{fmt(s.get('rss'), '.2f')} ({fmt(s.get('anon'), '.2f')})" + ratio(s.get("rss"), base.get("rss")))
                if s
                else "—",
                (fmt(s.get("single")) + ratio(s.get("single"), base.get("single"))) if s else "—",
                fmt(s.get("single_ttft"), ".0f") if s else "—",
                (fmt(s.get("conc")) + ratio(s.get("conc"), base.get("conc"))) if s else "—",
                f"{fmt(s.get('ttft50'))} / {fmt(s.get('ttft99'))}" if s else "—",
                f"{fmt(s.get('itl50'), '.0f')} / {fmt(s.get('itl99'), '.0f')}" if s else "—",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-q4km,1b-q4km,1b-q4_0,8b-q4km", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--compute", default="default", help="comma-separated `ifb build --compute` values; "
                        "default = no flag (e.g. default,int8 or auto,int8)")  # fmt: skip
    parser.add_argument("--build-args", default="", help="extra `ifb build` arguments (one shell-quoted string)")
    parser.add_argument(
        "--llama-args",
        default="",
        help="extra llama-server arguments (one shell-quoted string), e.g. -nr where its weight repacking crashes",
    )
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients (and llama-server -np)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--single-requests", type=int, default=3, help="sequential requests in the single-stream phase")
    parser.add_argument("--ctx-margin", type=int, default=128, help="extra tokens per sequence in both KV sizes")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t, ifb run --threads, llama-quantize")
    parser.add_argument("--rss-cap-gb", type=float, default=22.0, help="kill a build whose process tree passes this")
    parser.add_argument("--min-available-gb", type=float, default=1.0,
                        help="also kill a build when the machine's available memory drops below this")  # fmt: skip
    parser.add_argument("--build-timeout", type=float, default=3600)
    parser.add_argument("--build-threads-env", action="store_true", help="set OMP_NUM_THREADS=--threads for builds")
    parser.add_argument("--rebuild", action="store_true", help="rebuild engines that have a build record")
    parser.add_argument("--retry-failed", action="store_true", help="rebuild engines whose recorded build failed")
    parser.add_argument("--ifb-rev", default=None, help="run ifb from `git archive REV` (e.g. HEAD)")
    parser.add_argument("--ifb-tree", default=None, help="run ifb from this source tree")
    parser.add_argument(
        "--label", default=None, help="suffix for engine folders and table rows (e.g. the builder's commit)"
    )
    parser.add_argument("--skip-serve", action="store_true", help="build only, no serving comparison")
    parser.add_argument("--skip-llama", action="store_true", help="serve ifb only")
    parser.add_argument("--skip-build", action="store_true", help="never build llama.cpp (use the cached tools)")
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--merge", action="store_true", help="keep other models' entries of an existing JSON")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--report", action="store_true", help="print the table of an existing --output and exit")
    args = parser.parse_args()
    if args.report:
        data = json.loads(args.output.read_text())
        print(report(data))
        return

    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - set(MODELS)
    if unknown:
        raise SystemExit(f"unknown --models {sorted(unknown)}; known: {', '.join(MODELS)}")
    computes = [c for c in args.compute.split(",") if c]
    isa = cpu_isa()
    print(f"CPU: {isa['model_name']}, {os.cpu_count()} cores; ISA flags: {isa['summary']}", flush=True)
    llama_build = {} if args.skip_build else peers.build_llama_server(jobs=2, rebuild=False)
    if args.skip_build and peers.LLAMA_BUILD_JSON.is_file():
        llama_build = json.loads(peers.LLAMA_BUILD_JSON.read_text())
    inputs = ensure_inputs(models, threads=args.threads)
    ifb_cmd, ifb_desc = ifb_command(args)
    print(f"ifb: {ifb_desc}: {shlex.join(ifb_cmd)}", flush=True)

    prompts = None if args.skip_serve else make_prompts(tokenizer_dir(), args)

    previous = json.loads(args.output.read_text()).get("results", {}) if args.merge and args.output.is_file() else {}
    results: dict[str, Any] = dict(previous)
    for m in results.values():  # kept entries: engine.json details in today's form
        for e in m.get("ifb", {}).values():
            if (e.get("build") or {}).get("ok") and (ROOT / e["engine"] / "engine.json").is_file():
                e["build"]["engine_json"] = engine_summary(ROOT / e["engine"])
    ENGINES.mkdir(parents=True, exist_ok=True)
    ctx = args.clients * (args.prompt_tokens + args.max_tokens + args.ctx_margin)
    for model in models:
        gguf = inputs[model]
        entry: dict[str, Any] = {
            "file": str(gguf.relative_to(ROOT)),
            "file_mb": gguf.stat().st_size / 1e6,
            "tensor_types": tensor_types(gguf),
            "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "workload": workload(args),
            "ifb_source": ifb_desc,
            "ifb": {},
        }
        prev = previous.get(model)
        if prev:  # --merge: keep the other builds (other --compute / --label) and, with --skip-llama, llama's run
            entry["ifb"] = dict(prev.get("ifb", {}))
            if args.skip_llama and "llama" in prev:
                entry["llama"] = prev["llama"]
        results[model] = entry
        keys_now = []
        for compute in computes:
            key = f"{compute}@{args.label}" if args.label else compute
            engine = ENGINES / f"{model}-{compute}{'-' + args.label if args.label else ''}"
            entry["ifb"][key] = {
                "engine": str(engine.relative_to(ROOT)),
                "ifb_source": ifb_desc,
                "build": build_engine(ifb_cmd, gguf, engine, compute, args),
            }
            keys_now.append(key)
        if args.skip_serve:
            continue
        first_engine = ROOT / entry["ifb"][keys_now[0]]["engine"]
        if MODELS[model][0] == "moe" and (first_engine / "tokenizer").is_dir():
            prompts = make_prompts(first_engine, args)  # its own synthetic vocabulary sizes its prompts
        if not args.skip_llama:
            port = peers.free_port()
            llama = peers.Server(
                "llama-server",
                [str(peers.LLAMA_BIN), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                 "-np", str(args.clients), "-t", str(args.threads), "-c", str(ctx), "--cont-batching",
                 *shlex.split(args.llama_args)],
                BYO / f"{model}.llama-server.log", f"http://127.0.0.1:{port}", "content",
            )  # fmt: skip
            entry["llama"] = serve(llama, args, prompts)
        for compute in keys_now:
            e = entry["ifb"][compute]
            if not e["build"].get("ok"):
                continue
            port = peers.free_port()
            server = peers.Server(
                f"ifb {compute}",
                [*ifb_cmd, "run", str(ROOT / e["engine"]), "--host", "127.0.0.1", "--port", str(port),
                 "--threads", str(args.threads)],
                BYO / f"{model}-{compute}.ifb-run.log", f"http://127.0.0.1:{port}", "prompt",
            )  # fmt: skip
            e["serve"] = serve(server, args, prompts)
            if entry.get("llama", {}).get("ok") and e["serve"].get("ok"):
                e["greedy_common_prefix_chars"] = [
                    peers.common_prefix(a, b)
                    for a, b in zip(entry["llama"]["single_texts"], e["serve"]["single_texts"], strict=True)
                ]
        # write after every model: a later model's failure keeps the earlier numbers
        write_json(args, results, isa, ifb_desc, llama_build, ctx)

    write_json(args, results, isa, ifb_desc, llama_build, ctx)
    print()
    print(report(json.loads(args.output.read_text())))
    print(f"wrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}")


def report(data: dict[str, Any]) -> str:
    """The printed summary of a results JSON (also `--report`)."""
    results, isa, w = data["results"], data["cpu"], data["workload"]
    out = []
    isas = sorted(
        {
            str(e["build"]["engine_json"].get("kernel_isa"))
            for m in results.values()
            for e in m.get("ifb", {}).values()
            if (e.get("build") or {}).get("ok") and e["build"].get("engine_json")
        }
    )
    out.append(
        f"CPU: {isa['model_name']} ({data['cpu_count']} cores), ISA flags: {isa['summary']}; kernel ISA in engine.json: {isas}"
    )
    out.append(f"ifb: {data['ifb']}; llama.cpp: llama-cpp-python {data['llama_cpp_build'].get('version')}")
    out.append(
        f"{w['prompt_tokens']}-token prompts, {w['max_tokens']} output tokens (ignore_eos, temperature 0), streaming "
        f"/v1/completions; 1 stream = {w['single_requests']} sequential requests; {w['clients']} concurrent clients; "
        f"llama-server -np {w['clients']} -t {w['threads']} -c {w['llama_ctx']} {w.get('llama_args', '')}; "
        f"ifb engines --max-batch-size "
        f"{w['max_batch_size']}, same KV tokens. Ratios in () are ifb / llama-server."
    )
    out.append(table(results, w["clients"]))
    for model, m in results.items():
        if m.get("workload") and m["workload"] != {k: v for k, v in w.items() if k != "llama_ctx"}:
            out.append(f"{model}: measured with another workload: {m['workload']}")
        servers = [("llama-server", m.get("llama"))] + [
            (f"ifb {c}", e.get("serve")) for c, e in m.get("ifb", {}).items()
        ]
        loads = [
            f"{name} {r['load_before']:.1f}/{r['load_single']:.1f}/{r['load_concurrent']:.1f}"
            for name, r in servers
            if r and r.get("ok")
        ]
        if loads:
            out.append(
                f"{model} ({m.get('when')}): 1-min load average before / single / concurrent: {'; '.join(loads)}"
            )
        for compute, e in m.get("ifb", {}).items():
            if "greedy_common_prefix_chars" in e:
                out.append(
                    f"{model} ifb {compute}: greedy text common prefix with llama-server, chars: {e['greedy_common_prefix_chars']}"
                )
            b = e.get("build") or {}
            if b.get("ok") and b.get("engine_json", {}).get("build"):
                st = b["engine_json"]["build"]
                out.append(
                    f"{model} ifb {compute}: builder's own stage times {st.get('stage_seconds')} (total {st.get('seconds')} s of {b['wall_s']} s wall)"
                )
            if not b.get("ok"):
                tail = "\n    ".join((b.get("log_tail") or "").strip().splitlines()[-4:])
                out.append(f"{model} ifb {compute}: build failed ({b.get('log')}); last lines:\n    {tail}")
        for name, r in servers:
            if r and not r.get("ok"):
                out.append(f"{model} {name}: serving failed: {r.get('error')}")
    return "\n".join(out)


def workload(args) -> dict[str, Any]:
    return {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "clients": args.clients,
            "single_requests": args.single_requests, "threads": args.threads,
            "max_batch_size": args.max_batch_size, "compute": args.compute, "build_args": args.build_args,
            "llama_args": args.llama_args, "rss_cap_gb": args.rss_cap_gb, "ctx_margin": args.ctx_margin}  # fmt: skip


def write_json(args, results, isa, ifb_desc, llama_build, ctx) -> None:
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "workload": {**workload(args), "llama_ctx": ctx},
        "cpu": isa,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "memory_gb": gb(psutil.virtual_memory().total),
        "ifb": ifb_desc,
        "llama_cpp_build": llama_build,
        "command": shlex.join([sys.executable, *sys.argv]),
        "results": results,
        "table": table(results, args.clients),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
