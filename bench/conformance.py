"""llama.cpp's numerics as a second opinion: llama-server vs ifb (both compute modes) vs transformers.

    .venv/bin/python bench/conformance.py [--cases llama,qwen3,gemma3,...] [--append] [--compile]
                                          [--prompts N] [--files q4_k_m,...] [--new-tokens 32] [--skip-build]

For each case (a family of tests/e2e/test_converter_conformance.py's CASES, at K-quant-friendly
sizes: hidden 256, intermediate 512, head_dim 64, so every weight row is a multiple of 256) a tiny
trained-like HF checkpoint is written with transformers' own classes (tests/sharp_models.py),
converted by llama.cpp's own convert_hf_to_gguf.py (tests/llama_cpp_converter.py, the pinned
llama-cpp-python sdist) to F32 and Q8_0, and the F32 file quantized to Q4_K_M by llama-quantize
(built with llama-server by bench/peers.py's build_llama_server, from the same sdist). On each file:

- transformers fp32 on the HF folder: the reference (never reads the GGUF);
- llama-server (loopback, -np 1, -t 2, KV cache f32 so F32 files compare fp32 with fp32,
  --no-repack: its weight repack segfaults at load here on block files): POST
  /completion with the prompt as a JSON array of token ids (tokenize_mixed adds no BOS to an
  all-integer prompt, so tokenization cannot confound the comparison), temperature 0, n_probs =
  the whole vocabulary (pre-sampling logprobs from the raw logits), cache_prompt false,
  ignore_eos true, return_tokens true;
- ifb, built from the same GGUF by the real builder with `--compute fp32` and `--compute int8`
  (BuildOptions(compute=...), what `ifb build --compute` sets; int8 is refused on an F32 file,
  which has no block weights), driven token by token over Engine.step. By default the step runs
  eagerly without the AOT compile, as the conformance tests do (the family tests pin compiled ==
  eager); --compile builds and runs the compiled step.

llama-server's ignore_eos bans the end-of-generation ids by a -inf logit bias; transformers and ifb
ban the same ids (the file's tokenizer.ggml.{eos,eot,eom}_token_id), so all three run the same
greedy rule. Prompts: random ids in [3, vocab) (tests/step_cases.prompts), 11, 24, 37 and 50 tokens.

Per prompt: greedy agreement = generated tokens equal to transformers' before the first
divergence (of --new-tokens); first-token distance = |logprob - transformers' logprob| over
transformers' top 8 of the first generated position. A table row gives, per engine, the prompts
fully equal, the mean agreed prefix, and the median and max first-token distance over all
prompts x 8. Writes bench/out/conformance.json (per case after each case; --append keeps the
cases already there that this run does not redo).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]

from greedy_loop import scattered_blocks  # noqa: E402
from llama_cpp_converter import LLAMA_CPP_PYTHON_VERSION, convert_many  # noqa: E402
from peers import LLAMA_DIR, LLAMA_TARGETS, OUT, Server, build_llama_server, common_prefix, free_port  # noqa: E402
from sharp_models import VOCAB_SIZE, write_sharp_checkpoint  # noqa: E402
from step_cases import prompts as random_prompts  # noqa: E402
from test_converter_conformance import CASES, _uncompiled_step, oracle  # noqa: E402
from tiny_models import TINY_LIMITS  # noqa: E402

from ifb.builder import build as builder_build  # noqa: E402
from ifb.builder import compile_cpu  # noqa: E402
from ifb.builder.build import BuildOptions, build_engine  # noqa: E402
from ifb.builder.errors import BuildError  # noqa: E402
from ifb.plugins.quant_build import QuantLibrary, build_quant_library  # noqa: E402
from ifb.runtime.step.backend import StepMode  # noqa: E402
from ifb.runtime.step.engine import Engine  # noqa: E402
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs  # noqa: E402

logger = logging.getLogger(__name__)

DEFAULT_CASES = ("llama", "qwen3", "gemma3", "llama-llama3", "mistral", "qwen2-biases", "smollm3", "phi3", "gemma2")
FILES = ("f32", "q8_0", "q4_k_m")
TOP_K = 8
# Every weight row (q/k/v/gate/up: hidden; o: heads x head_dim; down: intermediate) a multiple
# of 256, K-quants' super-block, so llama-quantize's Q4_K_M falls back for no tensor.
SIZES: dict[str, Any] = dict(hidden_size=256, intermediate_size=512)
HEAD_DIM_FAMILIES = ("qwen3", "gemma2", "gemma3_text")  # tiny_config gives these a smaller head_dim
HEAD_DIM = 64
WORK = OUT / "conformance"
LLAMA_QUANTIZE = LLAMA_DIR / "bin" / "llama-quantize"


def case_overrides(name: str) -> dict[str, Any]:
    case = CASES[name]
    overrides = {**case.overrides, **SIZES}
    if case.family in HEAD_DIM_FAMILIES:
        overrides["head_dim"] = HEAD_DIM
    if case.family.startswith("gemma"):
        # llama.cpp scales Gemma's q by 1/sqrt(head_dim) (the file carries no query_pre_attn_scalar
        # for these sizes), so the checkpoint uses that value, as the tests' 16 = head_dim does
        overrides["query_pre_attn_scalar"] = HEAD_DIM
    return overrides


def make_files(name: str, seed: int) -> dict[str, Path]:
    """The HF folder and its F32 and Q8_0 GGUFs, written by llama.cpp's converter."""
    folder = WORK / name
    paths = {"hf": write_sharp_checkpoint(folder / "hf", CASES[name].family, seed=seed, **case_overrides(name))}
    for outtype in ("f32", "q8_0"):
        paths[outtype] = folder / f"{name}-{outtype}.gguf"
    convert_many([(paths["hf"], paths[o], o) for o in ("f32", "q8_0")])
    return paths


def quantize_q4_k_m(f32: Path, out: Path) -> Path:
    """llama-quantize's Q4_K_M of the F32 file (its own choice of types per tensor)."""
    done = subprocess.run([str(LLAMA_QUANTIZE), str(f32), str(out), "Q4_K_M"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama-quantize failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return out


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type the file holds."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for tensor in GGUFReader(path).tensors:
        kind = tensor.tensor_type.name
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def eog_ids(path: Path) -> list[int]:
    """The file's end-of-generation ids: the ones llama-server's ignore_eos bans."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    ids = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in fields:
            ids.add(int(fields[key].contents()))
    return sorted(ids)


def byte_token_ids(path: Path) -> list[int]:
    """The file's byte-fallback tokens (token type BYTE): the pieces that can leave a text
    incomplete UTF-8."""
    from gguf import GGUFReader

    types = GGUFReader(path).fields["tokenizer.ggml.token_type"].contents()
    return [i for i, kind in enumerate(types) if kind == 6]  # llama.cpp's LLAMA_TOKEN_TYPE_BYTE


# ---------------------------------------------------------------------------------------------
# the three runners: each returns, per prompt, (first-position logprobs over the vocab or a
# {id: logprob} map, greedy tokens)
# ---------------------------------------------------------------------------------------------

Run = list[tuple[dict[int, float], list[int]]]


def full_logprobs(logits: torch.Tensor) -> dict[int, float]:
    return dict(enumerate(torch.log_softmax(logits.double(), -1).tolist()))


def run_transformers(folder: Path, prompts: list[list[int]], new_tokens: int, banned: list[int]) -> Run:
    model = oracle(folder)
    out: Run = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            first = model(ids).logits[0, -1]
            generated = model.generate(
                ids,
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                suppress_tokens=banned or None,
            )
            out.append((full_logprobs(first), generated[0, len(prompt) :].tolist()))
    return out


_QUANT_LIBRARY: list[QuantLibrary] = []


def quant_library_once(out_dir: Path, isa: Any = None) -> QuantLibrary:
    """build_quant_library, compiled once per run: every engine of a run gets the same sources
    (it takes minutes on a busy 2-core machine, and 4 engines a case need it)."""
    if not _QUANT_LIBRARY:
        _QUANT_LIBRARY.append(build_quant_library(WORK / "quant-library", isa))
    return _QUANT_LIBRARY[0]


def build_ifb(gguf: Path, compute: str, folder: Path, compile_step: bool) -> Engine:
    options = BuildOptions(dtype="fp32", compute=compute, **TINY_LIMITS)
    if compile_step:
        build_engine(gguf, folder, options)
        return Engine.load(folder, StepMode.COMPILED)
    # as tests/e2e/test_converter_conformance.py builds its engines: no AOT compile, no calibration
    with (
        mock.patch.object(builder_build, "compile_in_child_process", _uncompiled_step),
        mock.patch.object(builder_build, "started_compile_process", nullcontext),
        mock.patch.object(builder_build, "calibrate_engine_folder", lambda *args, **kwargs: None),
        mock.patch.object(compile_cpu, "build_quant_library", quant_library_once),
    ):
        build_engine(gguf, folder, options)
    return Engine.load(folder, StepMode.EAGER, verify=False)


def run_ifb(engine: Engine, prompts: list[list[int]], new_tokens: int, banned: list[int]) -> Run:
    block_size = engine.config.limits.block_size
    out: Run = []
    for prompt in prompts:
        table = scattered_blocks(engine, len(prompt) + new_tokens)
        logits = engine.step(build_step_inputs([RequestSlice(prompt, 0, table, sample=True)], block_size))[0]
        first = full_logprobs(logits)
        tokens: list[int] = []
        while True:
            masked = logits.clone()
            masked[banned] = -float("inf")
            tokens.append(int(masked.argmax()))
            if len(tokens) == new_tokens:
                break
            position = len(prompt) + len(tokens) - 1
            inputs = build_step_inputs([RequestSlice([tokens[-1]], position, table, sample=True)], block_size)
            logits = engine.step(inputs)[0]
        out.append((first, tokens))
    return out


def run_llama(gguf: Path, prompts: list[list[int]], new_tokens: int, threads: int, log: Path) -> tuple[Run, int]:
    """llama-server's runs, and for how many prompts the first token was a partial UTF-8 byte."""
    port = free_port()
    cmd = [
        str(LLAMA_DIR / "bin" / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", "1", "-t", str(threads), "-c", "256", "-ctk", "f32", "-ctv", "f32",
        # its CPU repack of Q8_0/K-quant weights (the AMX/extra buffer types) segfaults at load on
        # this Xeon (AMX) for these files, 0.3.36; F32 files are not repacked either way
        "--no-repack",
    ]  # fmt: skip
    server = Server("llama-server", cmd, log, f"http://127.0.0.1:{port}", "content")
    byte_ids = byte_token_ids(gguf)
    partial_first = 0
    out: Run = []
    server.start(300)
    try:
        for prompt in prompts:
            body: dict[str, Any] = {
                "prompt": prompt,
                "n_predict": new_tokens,
                "temperature": 0.0,
                "n_probs": VOCAB_SIZE,
                "cache_prompt": False,
                "ignore_eos": True,
                "return_tokens": True,
            }
            reply = httpx.post(server.url + "/completion", json=body, timeout=300)
            reply.raise_for_status()
            data = reply.json()
            # completion_probabilities has one entry per piece of text sent, not per token (byte-
            # fallback tokens of one character share one): tokens come from return_tokens
            tokens = [int(t) for t in data["tokens"]]
            entries = data.get("completion_probabilities") or [{"id": -1}]  # none: every token partial
            probs = entries[0]
            if int(probs["id"]) != tokens[0]:
                # a token whose text ends in an incomplete UTF-8 character gets no probabilities
                # entry (server-context.cpp process_token), so entry 0 is a later position's. Ask
                # again for one token with the byte tokens banned: the ban is a sampler's logit
                # bias, and the logprobs reported are the raw logits' (pre-sampling), unchanged.
                partial_first += 1
                bytes_banned = {**body, "n_predict": 1, "logit_bias": [[t, False] for t in byte_ids]}
                again = httpx.post(server.url + "/completion", json=bytes_banned, timeout=300)
                again.raise_for_status()
                retry = again.json()
                probs = retry["completion_probabilities"][0]
                if int(probs["id"]) != int(retry["tokens"][0]) or int(probs["id"]) in byte_ids:
                    raise SystemExit(f"llama-server: no first-position logprobs for prompt {prompt[:8]}...")
            first = {int(p["id"]): float(p["logprob"]) for p in probs["top_logprobs"]}
            out.append((first, tokens))
    finally:
        server.stop()
    return out, partial_first


# ---------------------------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------------------------


def first_token_distances(run: Run, reference: Run) -> list[list[float]]:
    """Per prompt, |logprob - the reference's| over the reference's top TOP_K at the first position."""
    out = []
    for (first, _), (ref_first, _) in zip(run, reference, strict=True):
        top = sorted(ref_first, key=lambda t: -ref_first[t])[:TOP_K]
        missing = [t for t in top if t not in first]
        if missing:
            raise SystemExit(f"the engine returned no logprob for the reference's top ids {missing}")
        out.append([abs(first[t] - ref_first[t]) for t in top])
    return out


def spread(values: list[float]) -> list[float]:
    """Quartiles (25th, 50th, 75th percentile) of values."""
    return [float(q) for q in statistics.quantiles(values, n=4, method="inclusive")]


def score(run: Run, reference: Run, new_tokens: int) -> dict[str, Any]:
    prefixes = [common_prefix(tokens, ref_tokens) for (_, tokens), (_, ref_tokens) in zip(run, reference, strict=True)]
    per_prompt = first_token_distances(run, reference)
    deltas = [d for prompt in per_prompt for d in prompt]
    return {
        "agreed_prefix": prefixes,
        "prompts_equal": sum(p == new_tokens for p in prefixes),
        "mean_prefix": statistics.fmean(prefixes),
        "median_dlogprob": statistics.median(deltas),
        "max_dlogprob": max(deltas),
        "dlogprob_quartiles": spread(deltas),
        # per prompt, the median over its top 8: the unit a paired comparison of engines counts
        "prompt_median_dlogprob": [statistics.median(prompt) for prompt in per_prompt],
        "tokens": [tokens for _, tokens in run],
    }


def vs_dequantized(run: Run, ifb_fp32: Run) -> dict[str, Any]:
    """First-token distance from ifb fp32 on the same file: the file's weights dequantized exactly
    and multiplied in fp32, so what is left is the engine's own arithmetic (activation
    quantization, 16-bit intermediates), not the file's weight rounding."""
    deltas = [d for prompt in first_token_distances(run, ifb_fp32) for d in prompt]
    return {"median_dlogprob": statistics.median(deltas), "quartiles": spread(deltas), "max_dlogprob": max(deltas)}


def run_case(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    shutil.rmtree(WORK / name, ignore_errors=True)  # the builder writes no engine over an old one
    paths = make_files(name, seed)
    lengths = [args.lengths[i % len(args.lengths)] for i in range(args.prompts or len(args.lengths))]
    prompts = random_prompts(VOCAB_SIZE, lengths, seed=11)
    banned = eog_ids(paths["f32"])
    print(f"[{name}] files written; EOG ids banned for all: {banned}", flush=True)
    reference = run_transformers(paths["hf"], prompts, args.new_tokens, banned)
    result: dict[str, Any] = {
        "family": CASES[name].family,
        "overrides": case_overrides(name),
        "eog_banned": banned,
        "prompt_lengths": [len(p) for p in prompts],
        "transformers_tokens": [tokens for _, tokens in reference],
        "files": {},
    }
    for file in args.files:
        if file == "q4_k_m":
            paths[file] = quantize_q4_k_m(paths["f32"], WORK / name / f"{name}-q4_k_m.gguf")
        gguf = paths[file]
        entry: dict[str, Any] = {"tensor_types": tensor_types(gguf), "engines": {}}
        runs: dict[str, Run] = {}
        for compute in ("fp32", "int8"):
            key = f"ifb {compute}"
            try:
                engine = build_ifb(gguf, compute, WORK / name / f"engine-{file}-{compute}", args.compile)
            except BuildError as error:  # the builder's refusal (int8 on an F32 file) is a result
                if file != "f32":
                    raise
                entry["engines"][key] = {"refused": str(error).splitlines()[0]}
                continue
            runs[key] = run_ifb(engine, prompts, args.new_tokens, banned)
            entry["engines"][key] = score(runs[key], reference, args.new_tokens)
            del engine
        log = WORK / name / f"llama-server-{file}.log"
        llama, partial_first = run_llama(gguf, prompts, args.new_tokens, args.threads, log)
        entry["engines"] = {"llama.cpp": score(llama, reference, args.new_tokens), **entry["engines"]}
        entry["engines"]["llama.cpp"]["first_token_partial_utf8"] = partial_first
        for key, ours in runs.items():  # the second opinion read directly: ifb's tokens vs llama.cpp's
            entry["engines"][key]["agreed_prefix_vs_llama"] = [
                common_prefix(a, b) for (_, a), (_, b) in zip(ours, llama, strict=True)
            ]
        if file != "f32":  # each engine's own arithmetic, the file's rounding taken out
            entry["engines"]["llama.cpp"]["vs_ifb_fp32"] = vs_dequantized(llama, runs["ifb fp32"])
            entry["engines"]["ifb int8"]["vs_ifb_fp32"] = vs_dequantized(runs["ifb int8"], runs["ifb fp32"])
        result["files"][file] = entry
        print(table_rows({name: result}, only=file), flush=True)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def table_rows(results: dict[str, Any], only: str | None = None) -> str:
    lines = []
    for name, result in results.items():
        n_prompts = len(result["prompt_lengths"])
        for file, entry in result["files"].items():
            if only and file != only:
                continue
            types = ", ".join(f"{k} {v}" for k, v in entry["tensor_types"].items())
            for engine, s in entry["engines"].items():
                if "refused" in s:
                    cells = ["refused (no block weights)", "", "", "", ""]
                else:
                    vs_llama = s.get("agreed_prefix_vs_llama")
                    cells = [
                        f"{s['prompts_equal']}/{n_prompts}",
                        f"{s['mean_prefix']:.1f}",
                        f"{s['median_dlogprob']:.2g}",
                        f"{s['max_dlogprob']:.2g}",
                        f"{statistics.fmean(vs_llama):.1f}" if vs_llama else "",
                    ]
                lines.append(f"| {name} | {file.upper()} | {types} | {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


TABLE_HEAD = (
    "| case | file | tensor types | engine | greedy = HF, all 32 | mean agreed prefix | "
    "median abs dlogprob (top 8) | max abs dlogprob | mean agreed prefix with llama.cpp |"
    "\n|---|---|---|---|---|---|---|---|---|"
)


ARITHMETIC_HEAD = (
    "| case | file | engine | median abs dlogprob vs HF (25th-75th) | prompts farther than the other engine | "
    "median abs dlogprob vs ifb fp32 on the file (25th-75th) |\n|---|---|---|---|---|---|"
)


def arithmetic_rows(results: dict[str, Any]) -> str:
    """Quantized files only: each engine's spread, the paired per-prompt count, and its distance
    from ifb fp32 on the same file (the file's rounding taken out: the engine's own arithmetic)."""
    lines = []
    for name, result in results.items():
        for file, entry in result["files"].items():
            e = entry["engines"]
            if file == "f32" or "prompt_median_dlogprob" not in e.get("llama.cpp", {}):
                continue
            ours, theirs = e["ifb int8"]["prompt_median_dlogprob"], e["llama.cpp"]["prompt_median_dlogprob"]
            farther = {
                "ifb int8": sum(a > b for a, b in zip(ours, theirs, strict=True)),
                "llama.cpp": sum(b > a for a, b in zip(ours, theirs, strict=True)),
            }
            for engine in ("llama.cpp", "ifb int8"):
                s = e[engine]
                q, own = s["dlogprob_quartiles"], s["vs_ifb_fp32"]
                lines.append(
                    f"| {name} | {file.upper()} | {engine} | {q[1]:.3g} ({q[0]:.2g}-{q[2]:.2g}) | "
                    f"{farther[engine]}/{len(ours)} | {own['median_dlogprob']:.3g} "
                    f"({own['quartiles'][0]:.2g}-{own['quartiles'][2]:.2g}) |"
                )
    return "\n".join(lines)


def verdicts(results: dict[str, Any]) -> list[str]:
    """The issue's expectations, checked: F32 all agree; quantized int8 no farther than llama.cpp."""
    lines = []
    for name, result in results.items():
        for file, entry in result["files"].items():
            e = entry["engines"]
            if file == "f32":
                engines = [k for k, s in e.items() if "refused" not in s]
                n = len(result["prompt_lengths"])
                ok = all(e[k]["prompts_equal"] == n for k in engines)
                lines.append(f"{name} F32: {'all agree' if ok else 'DISAGREE'} ({', '.join(engines)})")
            else:
                ours, theirs = e["ifb int8"]["median_dlogprob"], e["llama.cpp"]["median_dlogprob"]
                word = "no farther" if ours <= theirs else "FARTHER"
                ifb_prompts = e["ifb int8"].get("prompt_median_dlogprob")  # absent in older outputs
                paired = ""
                if ifb_prompts is not None:
                    pairs = zip(ifb_prompts, e["llama.cpp"]["prompt_median_dlogprob"], strict=True)
                    paired = f"; ifb farther on {sum(a > b for a, b in pairs)} of {len(ifb_prompts)} prompts"
                lines.append(
                    f"{name} {file.upper()}: ifb int8 {word} than llama.cpp (median {ours:.3g} vs {theirs:.3g}{paired})"
                )
    return lines


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    global WORK  # noqa: PLW0603  (one run, one folder: every helper above writes under it)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--lengths", default="11,24,37,50", help="prompt lengths in tokens (<= 64)")
    parser.add_argument(
        "--prompts", type=int, default=0, help="how many prompts, lengths cycled (default: one per length)"
    )
    parser.add_argument("--files", default=",".join(FILES), help=f"of {', '.join(FILES)}")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t; torch threads")
    parser.add_argument("--compile", action="store_true", help="AOT-compile ifb's step (default: eager)")
    parser.add_argument("--append", action="store_true", help="keep the output's other cases")
    parser.add_argument("--skip-build", action="store_true", help="use the cached llama.cpp binaries, never build")
    parser.add_argument("--jobs", type=int, default=2, help="llama.cpp build parallelism")
    parser.add_argument("--output", type=Path, default=OUT / "conformance.json")
    parser.add_argument("--work", type=Path, default=WORK, help="files, engines and the quant library's build")
    args = parser.parse_args()
    WORK = args.work
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.files = args.files.split(",")
    if set(args.files) - set(FILES):
        raise SystemExit(f"--files: unknown {sorted(set(args.files) - set(FILES))}; known: {', '.join(FILES)}")
    if args.prompts < 0:
        raise SystemExit(f"--prompts: {args.prompts} < 0")
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    if max(args.lengths) > TINY_LIMITS["max_num_tokens"]:
        raise SystemExit(f"--lengths: at most {TINY_LIMITS['max_num_tokens']} tokens (the engine's step)")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    if args.skip_build:
        bins = [LLAMA_DIR / "bin" / t for t in LLAMA_TARGETS]
        if not all(b.is_file() for b in bins):
            raise SystemExit(f"--skip-build: missing {[str(b) for b in bins if not b.is_file()]}")
        build = json.loads((LLAMA_DIR / "build.json").read_text())
    else:
        build = build_llama_server(args.jobs, rebuild=False)
    if build.get("version") != LLAMA_CPP_PYTHON_VERSION:
        print(f"WARNING: llama.cpp built from llama-cpp-python {build.get('version')}, "
              f"the converter is {LLAMA_CPP_PYTHON_VERSION}", flush=True)  # fmt: skip

    report: dict[str, Any] = {"cases": {}}
    if args.append and args.output.is_file():
        report = json.loads(args.output.read_text())
    report.update(
        {
            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "llama_cpp": {k: build.get(k) for k in ("version", "llama_cpp_version")},
            "ifb_step": "compiled" if args.compile else "eager",
            "new_tokens": args.new_tokens,
            "top_k": TOP_K,
        }
    )
    WORK.mkdir(parents=True, exist_ok=True)
    for name in names:
        seed = list(CASES).index(name)  # the conformance tests' seed for this case
        report["cases"][name] = run_case(name, seed, args)
        args.output.write_text(json.dumps(report, indent=1))
    print(f"\n{TABLE_HEAD}\n{table_rows(report['cases'])}\n")
    print(f"{ARITHMETIC_HEAD}\n{arithmetic_rows(report['cases'])}\n")
    print("\n".join(verdicts(report["cases"])))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
