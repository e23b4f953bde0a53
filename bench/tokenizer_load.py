"""Time a 262k-vocabulary GGUF's metadata read as the build does it: config + tokenizer (`load_metadata`).

    .venv/bin/python bench/tokenizer_load.py [--before REV] [--repeats 3] [--vocab 262144]

Writes two synthetic files into a temporary folder (never the repository): a Gemma-3-like SentencePiece
vocabulary with scores and token types (arch `gemma3`, merges derived from the order) and a byte-level BPE
one with merges (arch `qwen2`, pre-tokenizer `qwen2`), each with a few small tensors, built with
tests/gguf_vocab.py's `synthetic_vocab`. Each measurement runs in a fresh interpreter (transformers and
tokenizers imported first, not timed) and reports CPU seconds (`time.process_time`) and wall seconds of
`builder.sources.load_metadata`, with the config part (`gguf_config`) and the tokenizer part apart.
`--before REV`: the same in a copy of REV's packages (git archive into the temporary folder), run
alternately with the working tree's, so both see the same machine load; /proc/loadavg is printed with
every measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

PACKAGES = ("builder", "runtime", "plugins", "cli")
EMBEDDING = 64

# Run in the child: imports first (not timed), then load_metadata with its two parts timed apart.
CHILD = r"""
import json, sys, time
import transformers, tokenizers, gguf  # noqa: F401  (imported by every build before this point)
from ifb.builder import sources
path = sources.resolve_source(sys.argv[1])
times = {}
def timed(name, fn):
    def wrapper(*args, **kwargs):
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name] = (time.process_time() - cpu, time.perf_counter() - wall)
    return wrapper
sources.gguf_config = timed("config", sources.gguf_config)
import ifb.builder.gguf_tokenizer as gt
gt.load_gguf_tokenizer = timed("tokenizer", gt.load_gguf_tokenizer)
cpu, wall = time.process_time(), time.perf_counter()
metadata = sources.load_metadata(path)
total = (time.process_time() - cpu, time.perf_counter() - wall)
text = "abc déjà 日本語 🙂 12345\n\n  x"
ids = metadata.tokenizer.encode(text, add_special_tokens=False)
assert metadata.tokenizer.decode(ids) == text, "the tokenizer does not round-trip"
print(json.dumps({"total": total, **times, "vocab": len(metadata.tokenizer),
                  "config_vocab": metadata.hf_config.vocab_size, "module": sources.__file__}))
"""


def write_file(path: Path, kind: str, vocab_size: int) -> Path:
    """A GGUF with a `vocab_size` vocabulary (kind "gemma3": SentencePiece with scores; "qwen2": byte-level
    BPE with merges), the keys its config needs and small tensors (embedding width EMBEDDING, one layer)."""
    import gguf
    import numpy as np
    from gguf_vocab import synthetic_vocab

    vocab = synthetic_vocab(vocab_size, "llama" if kind == "gemma3" else "gpt2")
    writer = gguf.GGUFWriter(str(path), kind)
    writer.add_name(f"synthetic-{kind}-{vocab_size}")
    for key, value in {
        "context_length": 32768,
        "embedding_length": EMBEDDING,
        "block_count": 1,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": 1,
        "attention.key_length": 16,
        "attention.value_length": 16,
    }.items():
        writer.add_uint32(f"{kind}.{key}", value)
    writer.add_float32(f"{kind}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{kind}.rope.freq_base", 1_000_000.0)
    if kind == "gemma3":
        writer.add_uint32("gemma3.attention.sliding_window", 512)
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre("default" if kind == "gemma3" else "qwen2")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges is not None:
        writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((vocab_size, EMBEDDING), dtype=np.float32) * 0.02)
    writer.add_tensor("output_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def packages_of(rev: str, folder: Path) -> Path:
    """REV's four packages under folder/ifb/, importable by PYTHONPATH=folder (ahead of the editable install)."""
    target = folder / "ifb"
    target.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *PACKAGES], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return folder


def measure(path: Path, pythonpath: Path | None) -> dict[str, object]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], env=env, capture_output=True, text=True, cwd=tempfile.gettempdir()
    )
    if run.returncode != 0:
        raise RuntimeError(f"the measurement failed:\n{run.stderr[-3000:]}")
    result: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    result["load"] = Path("/proc/loadavg").read_text().split()[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a git revision to time alternately with the working tree")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--kinds", default="gemma3,qwen2")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokenizer_load_") as tmp:
        folder = Path(tmp)
        variants: dict[str, Path | None] = {"now": None}
        if args.before:
            variants = {f"before ({args.before})": packages_of(args.before, folder / "before"), **variants}
        for kind in args.kinds.split(","):
            path = write_file(folder / f"{kind}.gguf", kind, args.vocab)
            print(f"{kind}: {path.stat().st_size / 1e6:.1f} MB, {args.vocab} tokens")
            results: dict[str, list[dict[str, object]]] = {name: [] for name in variants}
            for repeat in range(args.repeats):
                for name, pythonpath in variants.items():
                    result = measure(path, pythonpath)
                    results[name].append(result)
                    parts = "  ".join(
                        f"{part} {result[part][0]:.2f} CPU / {result[part][1]:.2f} wall"  # type: ignore[index]
                        for part in ("total", "config", "tokenizer")
                    )
                    print(f"  [{repeat}] {name:>24}: {parts}  (load {result['load']})")
            for name, runs in results.items():
                cpu = statistics.median(r["total"][0] for r in runs)  # type: ignore[index]
                wall = statistics.median(r["total"][1] for r in runs)  # type: ignore[index]
                print(f"  median {name:>24}: {cpu:.2f} s CPU, {wall:.2f} s wall")


if __name__ == "__main__":
    main()
