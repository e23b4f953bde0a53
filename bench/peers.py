"""Peer comparison: llama.cpp's llama-server vs `ifb run`, same GGUF, same client, same workload.

    .venv/bin/python bench/peers.py [--engine ENGINE_DIR] [--clients 32] [--prompt-tokens 256]
                                    [--max-tokens 128] [--skip-build] [--build-only]

llama-server is built from the llama-cpp-python source package (pip downloads the sdist; it vendors
llama.cpp under vendor/llama.cpp, nothing else is fetched) and cached in bench/out/llama.cpp/bin/.
Each server runs alone on loopback (one is stopped before the other starts), is warmed with two
requests, then gets:

  (a) single stream: requests one after another, PROMPT-token prompts, MAX-token outputs
      (ignore_eos, temperature 0): decode tokens/s from the streaming inter-token gaps (the first
      token excluded) and TTFT;
  (b) CLIENTS concurrent streaming clients, same sizes: total output tokens/s, TTFT p50/p99,
      ITL p50/p99.

Both are driven over /v1/completions with SSE by the same client code and request body. Prompts are
made of words from a fixed list, sized with the engine's tokenizer and checked against each
server's own /tokenize. Writes bench/out/peers.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
LLAMA_DIR = OUT / "llama.cpp"
LLAMA_BIN = LLAMA_DIR / "bin" / "llama-server"
LLAMA_BUILD_JSON = LLAMA_DIR / "build.json"
# The cmake targets built and cached in LLAMA_DIR/bin (llama-quantize: bench/byo_gguf.py's inputs).
LLAMA_TARGETS = ("llama-server", "llama-quantize")
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

# Common English words; with a leading space each is one token for SmolLM2's tokenizer, so a
# prompt's token count is close to its word count before the exact sizing below.
WORDS = """
time person year way day thing man world life hand part child eye woman place work week case point
government company number group problem fact water room mother area money story month lot right
study book job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back parent
face others level office door health art war history party result change morning reason research
girl guy moment air teacher force education foot boy age policy music market sense nation plan
college interest death experience effect class control care field development role effort rate
heart drug show leader light voice wife police mind price report decision son view relationship town
road arm difference value building action model season society tax director position player record
paper space ground form event official matter center couple site project activity star table need
court oil situation cost industry figure street image phone data picture practice piece land product
doctor wall patient worker news test movie north love support technology step baby computer type
attention film tree source organization hair window evidence population truth
""".split()


# ---------------------------------------------------------------------------------------------
# llama-server build
# ---------------------------------------------------------------------------------------------


def run_logged(cmd: list[str], log, cwd: Path | None = None) -> None:
    log.write(f"$ {shlex.join(cmd)}\n")
    log.flush()
    subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, check=True)


def cmake_options(src: Path) -> list[str]:
    """The configure flags, adapted to the option names this llama.cpp declares."""
    text = (src / "CMakeLists.txt").read_text()
    declared = set(re.findall(r"^\s*option\((\w+)", text, flags=re.M))
    if "LLAMA_BUILD_SERVER" not in declared:
        raise SystemExit(f"{src}/CMakeLists.txt declares no LLAMA_BUILD_SERVER option: update bench/peers.py")
    opts = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DGGML_NATIVE=ON",
        "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary to cache
        # ggml's AMX backend (on by -march=native where the CPU has AMX) crashed llama-server on its
        # first matmul on the AMX Xeon of 2026-12-04 (SIGSEGV in ggml_backend_amx_mul_mat, even with
        # the bundled SmolLM2; a tile program of our own ran there): the peer is measured with its
        # AVX-512/VNNI kernels, the ISA ifb's own kernels use. Explicit -mno-* win over -march=native.
        f"-DCMAKE_C_FLAGS={NO_AMX}",
        f"-DCMAKE_CXX_FLAGS={NO_AMX}",
    ]
    for name in ("LLAMA_BUILD_COMMON", "LLAMA_BUILD_TOOLS"):  # the server lives under tools/
        if name in declared:
            opts.append(f"-D{name}=ON")
    for name in ("LLAMA_BUILD_TESTS", "LLAMA_BUILD_EXAMPLES", "LLAMA_BUILD_APP"):
        if name in declared:
            opts.append(f"-D{name}=OFF")
    # Nothing may be fetched at build time: no HTTPS/downloads (LLAMA_CURL in older trees,
    # LLAMA_OPENSSL once it was deprecated), no web UI (npm build or prebuilt-asset download).
    for name in ("LLAMA_CURL", "LLAMA_OPENSSL", "LLAMA_BUILD_UI", "LLAMA_USE_PREBUILT_UI", "LLAMA_BUILD_WEBUI"):
        if name in declared:
            opts.append(f"-D{name}=OFF")
    return opts


def build_llama_server(jobs: int, rebuild: bool, targets: tuple[str, ...] = LLAMA_TARGETS) -> dict[str, Any]:
    """Build (or find cached) llama.cpp's `targets` into LLAMA_DIR/bin; returns the build record."""
    bins = [LLAMA_DIR / "bin" / t for t in targets]
    if all(b.is_file() for b in bins) and LLAMA_BUILD_JSON.is_file() and not rebuild:
        info = json.loads(LLAMA_BUILD_JSON.read_text())
        info["cached"] = True
        print(f"llama.cpp: cached {', '.join(map(str, bins))} (llama-cpp-python {info.get('version')})", flush=True)
        return info
    LLAMA_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LLAMA_DIR / "build.log"
    t0 = time.perf_counter()
    with open(log_path, "a") as log:
        sdist_dir = LLAMA_DIR / "sdist"
        sdists = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
        download_cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "llama-cpp-python", "-d", str(sdist_dir),
        ]  # fmt: skip
        if not sdists:
            print("llama-server: downloading the llama-cpp-python sdist", flush=True)
            run_logged(download_cmd, log)
            sdists = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
        sdist = sdists[-1]
        version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
        tree = LLAMA_DIR / f"llama_cpp_python-{version}"
        if not (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
            with tarfile.open(sdist) as tar:
                tar.extractall(LLAMA_DIR, filter="data")
        src = tree / "vendor" / "llama.cpp"
        build = LLAMA_DIR / "build"
        incremental = (build / "CMakeCache.txt").is_file()
        configure = ["cmake", "-S", str(src), "-B", str(build), *cmake_options(src)]
        compile_ = ["cmake", "--build", str(build), "--target", *targets, f"-j{jobs}"]
        print(f"llama.cpp: building {', '.join(targets)} from llama-cpp-python {version} (log: {log_path})", flush=True)
        t1 = time.perf_counter()
        run_logged(configure, log)
        t2 = time.perf_counter()
        run_logged(compile_, log)
        t3 = time.perf_counter()
    LLAMA_BIN.parent.mkdir(parents=True, exist_ok=True)
    for target, dest in zip(targets, bins, strict=True):
        shutil.copy2(build / "bin" / target, dest)
    version_out = subprocess.run([str(LLAMA_BIN), "--version"], capture_output=True, text=True, timeout=60)
    info = {
        "version": version,
        "llama_cpp_version": (version_out.stdout + version_out.stderr).strip(),
        "sdist": str(sdist.relative_to(ROOT)),
        "commands": [shlex.join(download_cmd), shlex.join(configure), shlex.join(compile_)],
        "configure_s": round(t2 - t1, 1),
        "build_s": round(t3 - t2, 1),
        "total_s": round(t3 - t0, 1),
        "jobs": jobs,
        "targets": list(targets),
        "incremental": incremental,  # an earlier build folder was reused: times cover only what was left
        "machine": platform.machine(),
        "cached": False,
    }
    LLAMA_BUILD_JSON.write_text(json.dumps(info, indent=2))
    print(f"llama.cpp: built in {info['total_s']:.0f} s -> {', '.join(map(str, bins))}", flush=True)
    return info


# ---------------------------------------------------------------------------------------------
# engine, prompts
# ---------------------------------------------------------------------------------------------


def default_gguf() -> Path:
    from ifb.builder.sources import default_model_path

    return default_model_path()


def pick_engine(given: str | None, gguf: Path) -> tuple[Path, str]:
    """--engine, else the quantized engine of the default model under engines/, else any engine."""
    if given:
        return Path(given).resolve(), "given by --engine"
    found = []
    for cfg in sorted((ROOT / "engines").glob("*/engine.json")):
        data = json.loads(cfg.read_text())
        source = data.get("source") or {}
        default = source.get("kind") == "default" or Path(source.get("path") or "/nonexistent") == gguf
        found.append((default, bool(data.get("weight_formats")), cfg.parent))
    for default, quantized, folder in found:
        if default and quantized:
            return folder, "the quantized engine of the default model"
    if found:
        default, quantized, folder = max(found, key=lambda f: (f[0], f[1]))
        note = (
            f"NO quantized default engine under engines/: using {folder.name} "
            f"(default model: {default}, quantized: {quantized})"
        )
        print("WARNING: " + note, flush=True)
        return folder, note
    raise SystemExit("no engine under engines/: build one (ifb build) or pass --engine")


def make_prompts(engine: Path, count: int, target: int, seed: int) -> list[str]:
    """`count` distinct prompts of `target` tokens each (by the engine's tokenizer, no specials).

    Each prompt is its own random draw of WORDS, so no two share a prefix (neither server gets to
    reuse cached KV between requests).
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(engine / "tokenizer" / "tokenizer.json"))

    def n_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    prompts = []
    for index in range(count):
        rng = random.Random(seed * 100_003 + index)
        words = [rng.choice(WORDS).capitalize()]
        while True:
            nxt = words + [rng.choice(WORDS)]
            if n_tokens(" ".join(nxt)) > target:
                break
            words = nxt
        prompts.append(" ".join(words))
    return prompts


# ---------------------------------------------------------------------------------------------
# servers
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return float("nan")


@dataclass
class Server:
    name: str
    cmd: list[str]
    log: Path
    url: str
    tokenize_key: str  # llama-server: {"content": ...}; ifb (vLLM-style): {"prompt": ...}
    proc: subprocess.Popen | None = None
    startup_s: float = 0.0

    def start(self, timeout: float) -> None:
        print(f"[{self.name}] starting: {shlex.join(self.cmd)}", flush=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        deadline = t0 + timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"[{self.name}] exited with {self.proc.returncode} at start; see {self.log}")
            if time.perf_counter() > deadline:
                self.stop()
                raise SystemExit(f"[{self.name}] not healthy after {timeout:.0f} s; see {self.log}")
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - t0
        print(f"[{self.name}] ready in {self.startup_s:.1f} s", flush=True)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def count_tokens(self, text: str) -> int:
        r = httpx.post(self.url + "/tokenize", json={self.tokenize_key: text}, timeout=60)
        r.raise_for_status()
        return len(r.json()["tokens"])


# ---------------------------------------------------------------------------------------------
# client
# ---------------------------------------------------------------------------------------------


@dataclass
class Stream:
    start: float
    events: list[float] = field(default_factory=list)  # arrival time of each SSE chunk with text
    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.events)

    @property
    def ttft(self) -> float:
        return self.events[0] - self.start

    @property
    def end(self) -> float:
        return self.events[-1]

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.events, self.events[1:], strict=False)]


def request_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    # The same body for both servers: OpenAI fields plus ignore_eos (a vLLM extra ifb declares;
    # llama-server reads it from /v1/completions as from /completion).
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


async def stream_one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> Stream:
    s = Stream(start=time.perf_counter())
    try:
        async with client.stream("POST", url + "/v1/completions", json=request_body(prompt, max_tokens)) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                usage = obj.get("usage")
                if usage:
                    s.completion_tokens = usage.get("completion_tokens")
                    s.prompt_tokens = usage.get("prompt_tokens")
                for choice in obj.get("choices") or ():
                    if choice.get("text"):
                        s.events.append(now)
                        s.text += choice["text"]
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    if s.error is None and not s.events:
        s.error = "no tokens streamed"
    return s


async def run_streams(url: str, prompts: list[str], max_tokens: int, concurrent: bool) -> tuple[list[Stream], float]:
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        t0 = time.perf_counter()
        if concurrent:
            streams = list(await asyncio.gather(*(stream_one(client, url, p, max_tokens) for p in prompts)))
        else:
            streams = [await stream_one(client, url, p, max_tokens) for p in prompts]
        return streams, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def check(streams: list[Stream], max_tokens: int, name: str, phase: str) -> list[str]:
    notes = []
    bad = [s.error for s in streams if s.error]
    if bad:
        raise SystemExit(f"[{name}] {phase}: {len(bad)} request(s) failed, first: {bad[0]}")
    short = [s.tokens for s in streams if s.tokens != max_tokens]
    if short:
        notes.append(f"{phase}: {len(short)} stream(s) returned {short[:4]} tokens, not {max_tokens}")
    multi = [(s.tokens, len(s.events)) for s in streams if len(s.events) != s.tokens]
    if multi:
        notes.append(f"{phase}: {len(multi)} stream(s) sent a different number of text chunks than tokens "
                     f"(tokens, chunks) e.g. {multi[:3]}; ITL is per chunk")  # fmt: skip
    return notes


def single_summary(streams: list[Stream]) -> dict[str, Any]:
    per = [(s.tokens - 1) / (s.end - s.events[0]) for s in streams if len(s.events) > 1 and s.end > s.events[0]]
    ttfts = [s.ttft for s in streams]
    gaps = [g for s in streams for g in s.gaps()]
    return {
        "requests": len(streams),
        "decode_tok_s_mean": sum(per) / len(per) if per else float("nan"),
        "decode_tok_s_per_request": per,
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "ttft_p50_s": pct(ttfts, 50),
        "ttfts_s": ttfts,
        "itl_p50_s": pct(gaps, 50),
        "tokens": [s.tokens for s in streams],
        "prompt_tokens_usage": [s.prompt_tokens for s in streams],
    }


def concurrent_summary(streams: list[Stream], wall: float) -> dict[str, Any]:
    total = sum(s.tokens for s in streams)
    span = max(s.end for s in streams) - min(s.start for s in streams)
    ttfts = [s.ttft for s in streams]
    gaps = [g for s in streams for g in s.gaps()]
    return {
        "clients": len(streams),
        "output_tokens": total,
        "span_s": span,
        "wall_s": wall,
        "output_tok_s": total / span,
        "ttft_p50_s": pct(ttfts, 50),
        "ttft_p99_s": pct(ttfts, 99),
        "ttft_max_s": max(ttfts),
        "itl_p50_s": pct(gaps, 50),
        "itl_p99_s": pct(gaps, 99),
        "itl_mean_s": sum(gaps) / len(gaps) if gaps else float("nan"),
        "tokens": [s.tokens for s in streams],
        "prompt_tokens_usage": [s.prompt_tokens for s in streams],
    }


def measure(
    server: Server,
    args,
    prompts: dict[str, list[str]],
    start_timeout: float,
    on_warm: Callable[[Server], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Start `server`, warm it, run (a) and (b), stop it. `on_warm(server)` (bench/byo_gguf.py: resident
    memory) runs after the warm-up; what it returns is stored as result["after_warmup"]."""
    result: dict[str, Any] = {"command": shlex.join(server.cmd), "log": str(server.log.relative_to(ROOT))}
    result["load_before"] = loadavg()
    server.start(start_timeout)
    try:
        result["startup_s"] = server.startup_s
        counts = [server.count_tokens(p) for p in prompts["single"] + prompts["concurrent"]]
        result["prompt_tokens_tokenize"] = {"min": min(counts), "max": max(counts), "mean": sum(counts) / len(counts)}
        print(f"[{server.name}] /tokenize: prompts are {min(counts)}-{max(counts)} tokens", flush=True)
        notes = []
        if max(abs(c - args.prompt_tokens) for c in counts) > 2:
            notes.append(
                f"/tokenize counts {min(counts)}-{max(counts)} differ from --prompt-tokens {args.prompt_tokens}"
            )
        warm, _ = asyncio.run(run_streams(server.url, prompts["warmup"], args.max_tokens, concurrent=False))
        notes += check(warm, args.max_tokens, server.name, "warmup")
        if on_warm is not None:
            result["after_warmup"] = on_warm(server)

        result["load_single"] = loadavg()
        single, _ = asyncio.run(run_streams(server.url, prompts["single"], args.max_tokens, concurrent=False))
        notes += check(single, args.max_tokens, server.name, "single")
        result["single"] = single_summary(single)
        result["single_texts"] = [s.text for s in single]
        print(
            f"[{server.name}] single: decode {result['single']['decode_tok_s_mean']:.1f} tok/s, "
            f"TTFT {1000 * result['single']['ttft_mean_s']:.0f} ms",
            flush=True,
        )

        result["load_concurrent"] = loadavg()
        conc, wall = asyncio.run(run_streams(server.url, prompts["concurrent"], args.max_tokens, concurrent=True))
        notes += check(conc, args.max_tokens, server.name, "concurrent")
        result["concurrent"] = concurrent_summary(conc, wall)
        c = result["concurrent"]
        print(
            f"[{server.name}] {len(conc)} clients: {c['output_tok_s']:.1f} tok/s, TTFT p50 {1000 * c['ttft_p50_s']:.0f} "
            f"ms, ITL p50 {1000 * c['itl_p50_s']:.0f} ms",
            flush=True,
        )
        result["load_after"] = loadavg()
        result["notes"] = notes
    finally:
        server.stop()
    return result


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

ROWS = [  # label, section, key, scale, higher_is_better
    ("single: decode tok/s", "single", "decode_tok_s_mean", 1, True),
    ("single: TTFT mean ms", "single", "ttft_mean_s", 1000, False),
    ("single: TTFT p50 ms", "single", "ttft_p50_s", 1000, False),
    ("N clients: output tok/s", "concurrent", "output_tok_s", 1, True),
    ("N clients: TTFT p50 ms", "concurrent", "ttft_p50_s", 1000, False),
    ("N clients: TTFT p99 ms", "concurrent", "ttft_p99_s", 1000, False),
    ("N clients: ITL p50 ms", "concurrent", "itl_p50_s", 1000, False),
    ("N clients: ITL p99 ms", "concurrent", "itl_p99_s", 1000, False),
]


def table(results: dict[str, dict[str, Any]], clients: int) -> tuple[str, dict[str, float]]:
    """One row per metric: llama-server, then each ifb server (`ifb`, `ifb[LABEL]`) with its ratio."""
    ifbs = [key for key in results if key != "llama"]
    head = " | ".join(f"{key} | {key}/llama" for key in ifbs)
    lines = [f"| metric | llama-server | {head} |", "| --- | ---: |" + " ---: | ---: |" * len(ifbs)]
    ratios = {}
    for label, section, key, scale, higher in ROWS:
        llama = results["llama"][section][key] * scale
        cells = []
        for name in ifbs:
            ifb = results[name][section][key] * scale
            ratio = ifb / llama if llama else float("nan")
            ratios[f"{section}.{key}" if name == "ifb" else f"{name}.{section}.{key}"] = ratio
            cells.append(f"{ifb:.1f} | {ratio:.2f}x")
        better = "higher is better" if higher else "lower is better"
        label = label.replace("N clients", f"{clients} clients")
        lines.append(f"| {label} ({better}) | {llama:.1f} | {' | '.join(cells)} |")
    return "\n".join(lines), ratios


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items (characters, token ids) a and b share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default=None, help="ifb engine folder (default: the quantized default engine)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent streaming clients in (b)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--single-requests", type=int, default=5, help="sequential requests in (a)")
    parser.add_argument("--slots", type=int, default=32, help="llama-server -np (ifb: the engine's 32 seats)")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t and ifb run --threads")
    parser.add_argument("--ctx-margin", type=int, default=128, help="extra tokens per llama-server slot")
    parser.add_argument("--order", default="llama,ifb", help="which server runs first")
    parser.add_argument(
        "--ifb-variant",
        action="append",
        default=[],
        metavar="LABEL=ARGS",
        help="also serve ifb with these extra `ifb run` arguments, measured as its own column in the same run "
        "(repeatable; e.g. off='--itl-target-ms 0'); listed after ifb in --order",
    )
    parser.add_argument("--skip-build", action="store_true", help="use the cached llama-server, never build")
    parser.add_argument("--rebuild", action="store_true", help="rebuild llama-server even if cached")
    parser.add_argument("--build-only", action="store_true", help="build (or find) llama-server and exit")
    parser.add_argument("--jobs", type=int, default=2, help="build parallelism")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=OUT / "peers.json")
    args = parser.parse_args()

    if args.skip_build:
        if not LLAMA_BIN.is_file():
            raise SystemExit(f"--skip-build: no cached llama-server at {LLAMA_BIN}")
        build = json.loads(LLAMA_BUILD_JSON.read_text()) if LLAMA_BUILD_JSON.is_file() else {}
        build["cached"] = True
    else:
        build = build_llama_server(args.jobs, args.rebuild)
    if args.build_only:
        return

    gguf = default_gguf()
    engine, engine_note = pick_engine(args.engine, gguf)
    engine_cfg = json.loads((engine / "engine.json").read_text())
    engine_gguf = (engine_cfg.get("source") or {}).get("path")
    same_model = engine_gguf is not None and Path(engine_gguf) == gguf
    print(f"GGUF: {gguf}\nengine: {engine} ({engine_note})", flush=True)
    if not same_model:
        print(f"WARNING: the engine was built from {engine_gguf}, not {gguf}", flush=True)

    n_single = args.single_requests
    all_prompts = make_prompts(engine, 2 + n_single + args.clients, args.prompt_tokens, args.seed)
    prompts = {
        "warmup": all_prompts[:2],
        "single": all_prompts[2 : 2 + n_single],
        "concurrent": all_prompts[2 + n_single :],
    }
    ctx = args.slots * (args.prompt_tokens + args.max_tokens + args.ctx_margin)
    ifb_exe = Path(sys.executable).parent / "ifb"
    ifb_cmd0 = [str(ifb_exe)] if ifb_exe.is_file() else [sys.executable, "-m", "ifb.cli.main"]

    servers = {}
    port = free_port()
    servers["llama"] = Server(
        "llama-server",
        [
            str(LLAMA_BIN), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(args.slots), "-t", str(args.threads), "-c", str(ctx), "--cont-batching",
        ],
        OUT / "peers-llama-server.log",
        f"http://127.0.0.1:{port}",
        "content",
    )  # fmt: skip
    port = free_port()
    servers["ifb"] = Server(
        "ifb",
        [*ifb_cmd0, "run", str(engine), "--host", "127.0.0.1", "--port", str(port), "--threads", str(args.threads)],
        OUT / "peers-ifb.log",
        f"http://127.0.0.1:{port}",
        "prompt",
    )

    order = args.order.split(",")
    variants = []
    for variant in args.ifb_variant:
        label, _, extra = variant.partition("=")
        key = f"ifb[{label}]"
        servers[key] = replace(
            servers["ifb"], name=key, cmd=[*servers["ifb"].cmd, *shlex.split(extra)], log=OUT / f"peers-ifb-{label}.log"
        )
        variants.append(key)
    after_ifb = order.index("ifb") + 1
    order[after_ifb:after_ifb] = variants

    results: dict[str, dict[str, Any]] = {}
    for key in order:
        results[key] = measure(servers[key], args, prompts, args.start_timeout)

    text, ratios = table(results, args.clients)
    same_text = [
        common_prefix(a, b)
        for a, b in zip(results["llama"]["single_texts"], results["ifb"]["single_texts"], strict=True)
    ]
    lengths = [len(t) for t in results["ifb"]["single_texts"]]
    notes = [f"{k}: {n}" for k in results for n in results[k]["notes"]]

    print()
    print(
        f"SmolLM2-135M-Instruct Q4_1 GGUF, {args.prompt_tokens}-token prompts, {args.max_tokens} output tokens "
        f"(ignore_eos, temperature 0), streaming /v1/completions; (a) {n_single} sequential requests, "
        f"(b) {args.clients} concurrent clients; each server alone, warmed with 2 requests."
    )
    print(text)
    print()
    print("commands:")
    for cmd in build.get("commands", []):
        print(f"  build: {cmd}")
    for key in results:
        print(f"  {servers[key].name}: {results[key]['command']}")
    print(f"  client: {shlex.join([sys.executable, *sys.argv])}")
    print()
    if build:
        print(
            f"llama-server: llama-cpp-python {build.get('version')} ({build.get('llama_cpp_version', '').splitlines()[0:1]}), "
            f"build {build.get('total_s')} s (configure {build.get('configure_s')} s, compile {build.get('build_s')} s"
            f", -j{build.get('jobs')}){' [cached]' if build.get('cached') else ''}"
        )
    for key in results:
        r = results[key]
        print(
            f"{servers[key].name}: startup {r['startup_s']:.1f} s, /tokenize prompt tokens "
            f"{r['prompt_tokens_tokenize']['min']}-{r['prompt_tokens_tokenize']['max']}, 1-min load "
            f"{r['load_before']:.2f} (before) {r['load_single']:.2f} (single) {r['load_concurrent']:.2f} (concurrent) "
            f"{r['load_after']:.2f} (after)"
        )
    print(f"greedy outputs, ifb vs llama-server, common prefix in chars: {same_text} of {lengths}")
    for note in notes:
        print(f"note: {note}")

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "workload": {
                    "prompt_tokens": args.prompt_tokens,
                    "max_tokens": args.max_tokens,
                    "single_requests": n_single,
                    "clients": args.clients,
                    "slots": args.slots,
                    "threads": args.threads,
                    "llama_ctx": ctx,
                    "request_body": {k: v for k, v in request_body("...", args.max_tokens).items()},
                },
                "gguf": str(gguf),
                "engine": str(engine),
                "engine_note": engine_note,
                "llama_server_build": build,
                "results": results,
                "ratios_ifb_over_llama": ratios,
                "greedy_common_prefix_chars": same_text,
                "notes": notes,
                "table": text,
                "cpu_count": os.cpu_count(),
            },
            indent=2,
        )
    )
    print(f"wrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}")


if __name__ == "__main__":
    main()
