"""The build's pack phase on a K-quant file, in file MB per second of wall and of CPU, and where it goes.

    .venv/bin/python bench/pack_phase.py [--layers 16] [--vocab 128256] [--compute int8|fp32] [--profile 25]
    .venv/bin/python bench/pack_phase.py --revs 098ac80,HEAD --repeats 2     # revisions alternated

Writes into a temporary folder (never the repository) a Llama-3.2-1B-shaped Q4_K_M-like GGUF (hidden 2048,
`--layers` layers, 32 / 8 heads of 64, FFN 8192, tied embedding; Q4_K q/k/o/gate/up, Q6_K v/down and
embedding, F32 norms) of random valid blocks (tests/tiny_models.py's `random_blocks`) with a `--vocab`-token
byte-level vocabulary (tests/gguf_vocab.py's `synthetic_vocab`), then times what builder.build does between
its "pack" and "compile" phases (`_convert`: open the tensors, plan, un-permute q/k, pack each tensor's
tiles out of the mapping and write them chunk by chunk, reload; a new file each run, as a build writes)
with `time.process_time` (all threads of this process) and wall, printing /proc/loadavg before and after.
`--profile N`: a second run under cProfile, its N largest functions by own time. `--revs A,B`: each
measurement in a fresh interpreter over that revision's packages (git archive, as bench/tokenizer_load.py
does; "." is the working tree), alternated `--repeats` times.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 2048, 8192, 32, 8, 64
# GGUF name -> (rows, cols, type) per layer, as Q4_K_M stores Llama-3.2-1B
LAYER = {
    "attn_q": (HEADS * HEAD_DIM, HIDDEN, "Q4_K"),
    "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN, "Q4_K"),
    "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN, "Q6_K"),
    "attn_output": (HIDDEN, HEADS * HEAD_DIM, "Q4_K"),
    "ffn_gate": (FFN, HIDDEN, "Q4_K"),
    "ffn_up": (FFN, HIDDEN, "Q4_K"),
    "ffn_down": (HIDDEN, FFN, "Q6_K"),
}


def write_file(path: Path, layers: int, vocab_size: int) -> Path:
    import gguf
    from gguf_vocab import synthetic_vocab
    from tiny_models import random_blocks

    vocab = synthetic_vocab(vocab_size, "gpt2")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("synthetic-1b-q4km")
    writer.add_context_length(8192)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges or [])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    rng = np.random.default_rng(0)

    def add(name: str, rows: int, cols: int, kind: str) -> None:
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, random_blocks(rows, cols, kind, rng), raw_dtype=qtype)

    add("token_embd.weight", vocab_size, HIDDEN, "Q6_K")
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for layer in range(layers):
        for name, (rows, cols, kind) in LAYER.items():
            add(f"blk.{layer}.{name}.weight", rows, cols, kind)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def pack_phase(path: Path, compute: str, out: Path) -> tuple[float, float]:
    """builder.build's pack phase (`_convert`) on `path`: (wall s, CPU s)."""
    from ifb.builder.build import BuildOptions, _convert
    from ifb.builder.hf_config import model_spec_from_hf_config
    from ifb.builder.limits import resolve_limits
    from ifb.builder.sources import load_metadata, resolve_source

    metadata = load_metadata(resolve_source(str(path)))
    spec = model_spec_from_hf_config(metadata.hf_config)
    options = BuildOptions(max_batch_size=4, max_num_tokens=64, max_seq_len=256, kv_memory_gb=1, compute=compute)
    limits = resolve_limits(
        spec,
        max_batch_size=4,
        max_num_tokens=64,
        max_seq_len=256,
        block_size=options.block_size,
        kv_dtype="float32",
        kv_blocks=None,
        kv_memory_gb=1,
    )
    wall, cpu = time.perf_counter(), time.process_time()
    _convert(metadata, limits, "float32", options, out)
    return time.perf_counter() - wall, time.process_time() - cpu


def child(path: Path, compute: str, profile: int) -> None:
    """One measurement in this interpreter: a JSON line of wall and CPU seconds (then the profile)."""
    import torch

    # each run writes a new file, as a build does into its staging folder: replacing the last run's
    # would free its page cache inside the timed phase and make ext4 flush the file on close (0.3 s)
    out = path.with_suffix(".weights")
    wall, cpu = pack_phase(path, compute, out)
    out.unlink()
    print(json.dumps({"wall": wall, "cpu": cpu, "threads": torch.get_num_threads()}), flush=True)
    if profile:
        stats = cProfile.Profile()
        stats.runcall(pack_phase, path, compute, out)
        out.unlink()
        pstats.Stats(stats).sort_stats("tottime").print_stats(profile)


def measure(path: Path, compute: str, profile: int, pythonpath: Path | None) -> tuple[dict[str, float], str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    command = [sys.executable, __file__, "--child", str(path), "--compute", compute, "--profile", str(profile)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if run.returncode != 0:
        raise RuntimeError(f"the measurement failed:\n{run.stderr[-3000:]}")
    first, _, rest = run.stdout.partition("\n")
    return json.loads(first), rest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--compute", default="int8", choices=("int8", "fp32"))
    parser.add_argument("--profile", type=int, default=0, help="then a cProfile run: its N largest functions")
    parser.add_argument("--revs", default=".", help="comma-separated git revisions; . is the working tree")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.compute, args.profile)
        return
    from tokenizer_load import packages_of

    with tempfile.TemporaryDirectory(prefix="pack_phase_") as tmp:
        folder = Path(tmp)
        path = write_file(folder / "1b-q4km.gguf", args.layers, args.vocab)
        size = path.stat().st_size
        print(f"{path.name}: {size / 1e6:.0f} MB, {args.vocab} tokens, --compute {args.compute}", flush=True)
        trees = {
            rev: None if rev == "." else packages_of(rev, folder / f"rev{i}")
            for i, rev in enumerate(args.revs.split(","))
        }
        for repeat in range(args.repeats):
            for rev, pythonpath in trees.items():
                load = Path("/proc/loadavg").read_text().split()[0]
                times, profile = measure(path, args.compute, args.profile, pythonpath)
                print(
                    f"  [{repeat}] {rev:>10}: pack phase {times['wall']:.2f} s wall, {times['cpu']:.2f} s CPU = "
                    f"{size / times['wall'] / 1e6:.0f} MB/s wall, {size / times['cpu'] / 1e6:.0f} MB/s per "
                    f"CPU-second ({times['threads']} torch threads; load {load} -> "
                    f"{Path('/proc/loadavg').read_text().split()[0]})",
                    flush=True,
                )
                if profile.strip():
                    print(profile)


if __name__ == "__main__":
    main()
