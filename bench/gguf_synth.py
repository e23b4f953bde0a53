"""Synthetic "bring your own GGUF" inputs, made locally (no weights are downloaded).

    .venv/bin/python bench/gguf_synth.py [--models smollm2-q4km,1b-q4km,1b-q4_0,8b-q4km] [--force]
    .venv/bin/python bench/gguf_synth.py --check-tiny      # tiny model: transformers and llama.cpp load it

Writes under bench/out/byo/ (kept between runs; a file that exists is not made again):

  smollm2-q4km.gguf  the bundled SmolLM2-135M (Q4_1) requantized by `llama-quantize --allow-requantize`
  1b-f16.gguf        Llama-3.2-1B-shaped (hidden 2048, 16 layers, 32 heads / 8 KV heads, head_dim 64,
                     FFN 8192, tied embeddings, rope theta 500000), random weights, F16
  1b-q4km.gguf       that, `llama-quantize ... Q4_K_M`
  1b-q4_0.gguf       that, `llama-quantize ... Q4_0`
  1b48-q4_0.gguf     the 1B's width with 48 layers, Q4_0 (its F16 file is deleted once quantized)
  1b48-q4km.gguf     the same, Q4_K_M (Q6_K in the layers llama.cpp keeps at more bits)
  8b-q4km.gguf       Llama-3.1-8B-shaped (hidden 4096, 32 layers, 32 / 8 heads, FFN 14336, untied
                     output), random weights, via an F16 file that is deleted once quantized
                     (--keep-f16 keeps it: 16 GB)

Every synthetic model takes SmolLM2's tokenizer (vocab 49152) and chat template from the bundled
GGUF's metadata, arch "llama". Random weights are N(0, 0.02) (norm weights 1.0): each tensor is cut,
at a random offset, from one fixed pool of 2^26 normal draws (generating 8 G fresh normals on 2
cores would take ~10 minutes; the benchmark only needs realistic sizes and value ranges). Tensors are
streamed to the file in row chunks (GGUFWriter's header and tensor-info writers, then the data
written chunk by chunk with the writer's alignment), so writing the 8B model takes a few hundred MB
of RAM. q/k rows are written as they are drawn: llama.cpp's convert_hf_to_gguf permutes HF's q/k
rows to its rotary layout and transformers' GGUF loader undoes that, so with random weights any rows
are a valid llama.cpp-layout file that both load the same way (--check-tiny verifies both load it and
agree on the next token).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

if TYPE_CHECKING:
    import gguf

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import LLAMA_DIR, OUT, build_llama_server  # noqa: E402

BYO = OUT / "byo"
QUANTIZE_BIN = LLAMA_DIR / "bin" / "llama-quantize"
POOL_SIZE = 1 << 26
CHUNK_ELEMENTS = 1 << 24  # 32 MB of F16 per write


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    rope_theta: float = 500000.0
    context: int = 8192
    rms_eps: float = 1e-5

    def tensors(self, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape = (rows, row length)) in convert_hf_to_gguf's order."""
        h, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.ffn
        out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, h))]
        for i in range(self.layers):
            out += [
                (f"blk.{i}.attn_norm.weight", (h,)),
                (f"blk.{i}.attn_q.weight", (q, h)),
                (f"blk.{i}.attn_k.weight", (kv, h)),
                (f"blk.{i}.attn_v.weight", (kv, h)),
                (f"blk.{i}.attn_output.weight", (h, q)),
                (f"blk.{i}.ffn_norm.weight", (h,)),
                (f"blk.{i}.ffn_gate.weight", (f, h)),
                (f"blk.{i}.ffn_up.weight", (f, h)),
                (f"blk.{i}.ffn_down.weight", (h, f)),
            ]
        out.append(("output_norm.weight", (h,)))
        if not self.tied:
            out.append(("output.weight", (vocab, h)))
        return out


SHAPES = {
    "1b": Shape("Llama-3.2-1B-shaped (random)", 2048, 16, 32, 8, 64, 8192, tied=True),
    "8b": Shape("Llama-3.1-8B-shaped (random)", 4096, 32, 32, 8, 128, 14336, tied=False),
    # the 1B's width at three times its depth: #39's compile time that does not grow with depth
    "1b48": Shape("Llama-3.2-1B-width, 48 layers (random)", 2048, 48, 32, 8, 64, 8192, tied=True),
    "tiny": Shape("tiny llama (random)", 256, 2, 4, 2, 64, 768, tied=True),
}

# model key -> (source, llama-quantize type, needs --allow-requantize)
MODELS = {
    "smollm2-q4km": ("bundled", "Q4_K_M", True),
    "1b-q4km": ("1b", "Q4_K_M", False),
    "1b-q4_0": ("1b", "Q4_0", False),
    "1b48-q4_0": ("1b48", "Q4_0", False),
    "1b48-q4km": ("1b48", "Q4_K_M", False),
    "8b-q4km": ("8b", "Q4_K_M", False),
    # mixtures of experts, random valid blocks written directly (bench/moe_synth.py): full depth for
    # the memory rows, 12 of 48 / 6 of 24 layers for the speed rows
    "qwen3moe-30b-a3b-q4km": ("moe", "Q4_K_M", False),
    "qwen3moe-30b-a3b-q4km-12l": ("moe", "Q4_K_M", False),
    "gpt-oss-20b-mxfp4": ("moe", "MXFP4", False),
    "gpt-oss-20b-mxfp4-6l": ("moe", "MXFP4", False),
}


def bundled_gguf() -> Path:
    from ifb.builder.sources import default_model_path

    return Path(default_model_path())


def tokenizer_fields(src: Path) -> list[tuple[str, object, object, object]]:
    """(key, value, type, array sub-type) of every tokenizer.* entry of a GGUF."""
    import gguf

    reader = gguf.GGUFReader(src)
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if main == gguf.GGUFValueType.ARRAY else None
        out.append((key, field.contents(), main, sub))
    return out


def write_metadata(writer: gguf.GGUFWriter) -> tuple[BinaryIO, int]:
    """Writes `writer`'s header, key-values and tensor infos; returns its open file and the data
    alignment, for tensor bytes streamed in after them (each padded to the alignment)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    return writer.fout[0], writer.data_alignment  # type: ignore[index]


def write_random_f16(path: Path, shape: Shape, seed: int = 0) -> dict[str, object]:
    """Stream a random-weight F16 llama GGUF of `shape` to `path` (via path.partial)."""
    import gguf

    t0 = time.perf_counter()
    tok = tokenizer_fields(bundled_gguf())
    vocab = next(len(v) for k, v, _, _ in tok if k == "tokenizer.ggml.tokens")  # type: ignore[arg-type]
    tensors = shape.tensors(vocab)
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, "llama")
    writer.add_type("model")
    writer.add_name(shape.name)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(shape.head_dim)
    if shape.head_dim * shape.heads != shape.hidden:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub in tok:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, shp in tensors:
        dtype = np.float32 if len(shp) == 1 else np.float16  # 1-D (norms) stay F32, as in convert_hf_to_gguf
        writer.add_tensor_info(name, shp, np.dtype(dtype), int(np.prod(shp)) * np.dtype(dtype).itemsize)
    fout, align = write_metadata(writer)

    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(POOL_SIZE, dtype=np.float32) * 0.02).astype(np.float16)
    pool2 = np.concatenate([pool, pool[:CHUNK_ELEMENTS]])  # any window of CHUNK_ELEMENTS is a view
    total = 0
    for _name, shp in tensors:
        fout.write(b"\0" * (-fout.tell() % align))
        n = int(np.prod(shp))
        if len(shp) == 1:
            np.ones(n, dtype=np.float32).tofile(fout)
            total += 4 * n
        else:
            done = 0
            while done < n:
                k = min(CHUNK_ELEMENTS, n - done)
                start = int(rng.integers(0, POOL_SIZE))
                pool2[start : start + k].tofile(fout)
                done += k
            total += 2 * n
    fout.write(b"\0" * (-fout.tell() % align))
    writer.close()
    partial.rename(path)
    return {"tensors": len(tensors), "data_bytes": total, "write_s": round(time.perf_counter() - t0, 1)}


def tensor_types(path: Path) -> dict[str, int]:
    import gguf

    reader = gguf.GGUFReader(path)
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    return dict(counts.most_common())


def describe(path: Path) -> str:
    types = ", ".join(f"{k} x{v}" for k, v in tensor_types(path).items())
    return f"{path.relative_to(ROOT)}: {path.stat().st_size / 1e6:,.0f} MB ({types})"


def quantize(src: Path, dst: Path, qtype: str, requant: bool, threads: int) -> dict[str, object]:
    if not QUANTIZE_BIN.is_file():
        raise SystemExit(f"no {QUANTIZE_BIN}: run bench/peers.py --build-only (builds llama-quantize too)")
    partial = dst.with_suffix(".partial")
    cmd = [str(QUANTIZE_BIN), *(["--allow-requantize"] if requant else []), str(src), str(partial), qtype, str(threads)]
    log = dst.with_suffix(".quantize.log")
    print(f"$ {shlex.join(cmd)}  (log: {log.relative_to(ROOT)})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True)
    partial.rename(dst)
    return {"command": shlex.join(cmd), "quantize_s": round(time.perf_counter() - t0, 1)}


def ensure_f16(key: str) -> Path:
    path = BYO / f"{key}-f16.gguf"
    if not path.is_file():
        print(f"writing {path.relative_to(ROOT)} ({SHAPES[key].name})", flush=True)
        info = write_random_f16(path, SHAPES[key])
        print(f"  {info}", flush=True)
    return path


def write_moe_input(key: str, dst: Path) -> dict[str, object]:
    """A mixture-of-experts key ("MODEL" or "MODEL-NL" for N of its layers) written by bench/moe_synth.py."""
    from moe_synth import SHAPES as MOE_SHAPES
    from moe_synth import write_moe_gguf

    reduced = re.fullmatch(r"(.+)-(\d+)l", key)
    shape = MOE_SHAPES[reduced.group(1) if reduced else key]
    layers = int(reduced.group(2)) if reduced else shape.layers
    print(f"writing {dst.relative_to(ROOT)} ({shape.name}, {layers} layers)", flush=True)
    info = write_moe_gguf(dst, shape, layers)
    print(f"  {info}", flush=True)
    return info


def ensure_inputs(models: list[str], threads: int = 2, force: bool = False, keep_f16: bool = False) -> dict[str, Path]:
    """Make (or find) bench/out/byo/<model>.gguf for each model key; returns key -> path."""
    BYO.mkdir(parents=True, exist_ok=True)
    record_path = BYO / "inputs.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    out = {}
    for key in models:
        source, qtype, requant = MODELS[key]
        dst = BYO / f"{key}.gguf"
        if force and dst.is_file():
            dst.unlink()
        if not dst.is_file() and source == "moe":
            info = write_moe_input(key, dst)
            record[key] = {"source": "bench/moe_synth.py", "type": qtype, **info}
            record_path.write_text(json.dumps(record, indent=2))
        elif not dst.is_file():
            src = bundled_gguf() if source == "bundled" else ensure_f16(source)
            info = quantize(src, dst, qtype, requant, threads)
            record[key] = {"source": str(src), "type": qtype, **info}
            record_path.write_text(json.dumps(record, indent=2))
            if source in ("8b", "1b48") and not keep_f16:
                src.unlink()  # 16 GB (8B), 5.8 GB (1b48); remade (~minutes) only if the quantized file is deleted
        out[key] = dst
        print(describe(dst), flush=True)
    return out


def check_tiny() -> None:
    """Write a tiny F16 model and its Q4_0 and check transformers and llama.cpp read the same model."""
    import torch
    from transformers import AutoModelForCausalLM

    BYO.mkdir(parents=True, exist_ok=True)
    path = BYO / "tiny-f16.gguf"
    path.unlink(missing_ok=True)
    write_random_f16(path, SHAPES["tiny"], seed=1)
    print(describe(path))
    model = AutoModelForCausalLM.from_pretrained(str(BYO), gguf_file=path.name, dtype=torch.float32)
    ids = [1, 504, 3458, 282, 260, 2365, 30]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    hf_top = torch.topk(logits, 5).indices.tolist()
    print(f"transformers: loaded {sum(p.numel() for p in model.parameters()):,} parameters; top-5 next {hf_top}")
    server = LLAMA_DIR / "bin" / "llama-server"
    if not server.is_file():
        print("llama-server not built: skipped the llama.cpp side")
        return
    import httpx
    from peers import free_port

    port = free_port()
    proc = subprocess.Popen(
        [str(server), "-m", str(path), "--port", str(port), "-t", "2", "-c", "256", "-np", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(240):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        body = {"prompt": ids, "n_predict": 1, "n_probs": 5, "temperature": 0, "post_sampling_probs": False}
        r = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=120).json()
        probs = r["completion_probabilities"][0]
        llama_top = [p["id"] for p in probs.get("top_logprobs", probs.get("probs", []))]
        print(f"llama.cpp: top-5 next {llama_top}")
        print("AGREE" if llama_top[:1] == hf_top[:1] else "DISAGREE", "on the next token")
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--threads", type=int, default=2, help="llama-quantize threads")
    parser.add_argument("--force", action="store_true", help="re-quantize even if the file exists")
    parser.add_argument("--keep-f16", action="store_true", help="keep the 8B F16 intermediate (16 GB)")
    parser.add_argument("--skip-build", action="store_true", help="never build llama.cpp (use the cached tools)")
    parser.add_argument("--check-tiny", action="store_true", help="tiny model: transformers vs llama.cpp")
    args = parser.parse_args()
    if args.check_tiny:
        check_tiny()
        return
    if not args.skip_build:
        build_llama_server(jobs=2, rebuild=False)
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - set(MODELS)
    if unknown:
        raise SystemExit(f"unknown --models {sorted(unknown)}; known: {', '.join(MODELS)}")
    ensure_inputs(models, threads=args.threads, force=args.force, keep_f16=args.keep_f16)


if __name__ == "__main__":
    main()
