"""Quality of opt-in modes against the exact engine: teacher-forced agreement and KL, same prompts.

    .venv/bin/python bench/quality.py --reference engines/smollm2-b32-t512-q4_1 \\
        --candidate engines/smollm2-b32-t512-q4_1-kvfp16 --candidate engines/smollm2-b32-t512-q4_1-kvq8_0 \\
        [--candidate ...] [--max-new-tokens 64] [--kernels REV]

Sixteen fixed chat prompts (PROMPTS below: facts, code, arithmetic, lists, translation, a story,
a system prompt) go through the reference engine's chat template. The reference generates its
greedy continuation of each (up to --max-new-tokens, stopping after an end-of-sequence token).
Each candidate is then teacher-forced along that token path, and at every position of it:

  top-1 agreement   the fraction of positions where the candidate's argmax is the reference's token
  mean KL           KL(reference || candidate) of the two next-token distributions (full
                    vocabulary, float64), averaged over all positions (nats)

and, run freely, the fraction of prompts whose greedy output is identical to the reference's; each
row states the KV bytes a token costs in its pool (all layers, K and V), the price of a KV format.
Both engines are driven through the runtime's step (`Engine.step` over `build_step_inputs`),
which returns full-vocabulary fp32 logits: decodes of one group of prompts share each step, as
they do when served. Prints a table; writes bench/out/quality.json.

`--kernels REV` runs every engine on the kernel library built from plugins/csrc as it is at git
revision REV (loaded before any engine's own, so the process uses it): the same int8 engine then
measures an older activation scheme, e.g. per-32 scales for the K-quants before #38's per-256.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ifb.runtime.engine_format import EngineConfig, EngineLimits, kv_bytes_per_block
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in two or three sentences."}
PROMPTS: tuple[tuple[dict[str, str], ...], ...] = tuple(
    tuple(m) if isinstance(m, tuple) else ({"role": "user", "content": m},)
    for m in (
        "What is the capital of France?",
        "Explain photosynthesis to a ten-year-old.",
        "Write a Python function that returns the n-th Fibonacci number.",
        "What is 17 multiplied by 23? Show your working.",
        "List five fruits that are red.",
        "Translate 'Good morning, how are you?' into Spanish and German.",
        "Write the opening of a short story about a lighthouse keeper who finds a message in a bottle.",
        "What are the main differences between TCP and UDP?",
        "Give me three tips for sleeping better.",
        "Who wrote Pride and Prejudice, and when was it published?",
        "Summarize the water cycle in one paragraph.",
        "What does the SQL statement SELECT COUNT(*) FROM users WHERE age > 30 do?",
        "Write a haiku about autumn rain.",
        (SYSTEM, {"role": "user", "content": "Why is the sky blue?"}),
        (SYSTEM, {"role": "user", "content": "How do vaccines train the immune system?"}),
        "If a train leaves at 3 pm and travels 120 km at 80 km/h, when does it arrive?",
    )
)
Chooser = Callable[[int, int, torch.Tensor], int]  # (prompt index, position, logits row) -> next token


@dataclass(frozen=True, slots=True)
class Continuation:
    """The tokens after one prompt and, for each, the fp32 logits it was chosen from."""

    token_ids: list[int]
    logits: torch.Tensor  # [len(token_ids), vocab]


def chat_prompts(config: EngineConfig, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(config.tokenizer_path))
    return [
        list(tokenizer.apply_chat_template(list(m), add_generation_prompt=True, tokenize=True, return_dict=False))
        for m in PROMPTS[:count]
    ]


def stop_token_ids(config: EngineConfig) -> set[int]:
    """What the server stops a request on: the model's EOS ids and the tokenizer's."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(config.tokenizer_path)).eos_token_id
    return set(config.spec.eos_token_ids) | ({eos} if eos is not None else set())


def groups(lengths: Sequence[int], limits: EngineLimits) -> list[list[int]]:
    """Prompt indices in groups that fit the engine at once: at most max_batch_size requests
    whose blocks (prompt + continuation each) fit the KV pool."""
    out: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, length in enumerate(lengths):
        need = math.ceil(length / limits.block_size)
        if length > limits.max_seq_len or need > limits.num_kv_blocks:
            raise SystemExit(f"prompt {index}: {length} tokens do not fit max_seq_len {limits.max_seq_len}")
        if current and (len(current) == limits.max_batch_size or used + need > limits.num_kv_blocks):
            out.append(current)
            current, used = [], 0
        current.append(index)
        used += need
    return out + ([current] if current else [])


def continue_prompts(
    engine: Engine, prompts: list[list[int]], choose: Chooser, max_lengths: list[int], stop_ids: set[int]
) -> list[Continuation]:
    """Each prompt prefilled (in chunks of max_num_tokens), then one token per step, the group's
    decodes sharing each step; prompt i stops after max_lengths[i] tokens or a stop token."""
    limits = engine.config.limits
    block_size = limits.block_size
    results: dict[int, Continuation] = {}
    for group in groups([len(prompts[i]) + max_lengths[i] for i in range(len(prompts))], limits):
        tables: dict[int, list[int]] = {}
        next_block = 0
        for i in group:
            count = math.ceil((len(prompts[i]) + max_lengths[i]) / block_size)
            tables[i] = list(range(next_block, next_block + count))
            next_block += count
        current: dict[int, torch.Tensor] = {}
        for i in group:
            prompt = prompts[i]
            for start in range(0, len(prompt), limits.max_num_tokens):
                piece = prompt[start : start + limits.max_num_tokens]
                logits = engine.step(build_step_inputs([RequestSlice(piece, start, tables[i], True)], block_size))
            current[i] = logits[0]
        tokens: dict[int, list[int]] = {i: [] for i in group}
        rows: dict[int, list[torch.Tensor]] = {i: [] for i in group}
        active = list(group)
        while active:
            for i in active:
                rows[i].append(current[i])
                tokens[i].append(choose(i, len(tokens[i]), current[i]))
            active = [i for i in active if len(tokens[i]) < max_lengths[i] and tokens[i][-1] not in stop_ids]
            if not active:
                break
            slices = [
                RequestSlice([tokens[i][-1]], len(prompts[i]) + len(tokens[i]) - 1, tables[i], True) for i in active
            ]
            logits = engine.step(build_step_inputs(slices, block_size))
            current = {i: logits[row] for row, i in enumerate(active)}
        for i in group:
            results[i] = Continuation(tokens[i], torch.stack(rows[i]))
    return [results[i] for i in range(len(prompts))]


def greedy(_: int, __: int, logits: torch.Tensor) -> int:
    return int(logits.argmax())


def compare(reference: list[Continuation], teacher_forced: list[Continuation]) -> dict[str, Any]:
    """Top-1 agreement and KL(reference || candidate) over every position of every prompt."""
    agree, kls = 0, []
    for ref, cand in zip(reference, teacher_forced, strict=True):
        target = torch.tensor(ref.token_ids)
        agree += int((cand.logits.argmax(-1) == target).sum())
        log_p = torch.log_softmax(ref.logits.double(), -1)
        log_q = torch.log_softmax(cand.logits.double(), -1)
        kls.append((log_p.exp() * (log_p - log_q)).sum(-1))
    kl = torch.cat(kls)
    return {
        "positions": int(kl.numel()),
        "top1_agreement": agree / kl.numel(),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
    }


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two greedy outputs differ (None: identical)."""
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def kv_bytes_per_token(config: EngineConfig) -> int:
    block_size = config.limits.block_size
    return kv_bytes_per_block(config.spec, block_size, config.kv_dtype) // block_size


def label(config: EngineConfig) -> str:
    formats = sorted(set(config.weight_formats.values())) or ["dense"]
    return f"{config.folder.name} ({'+'.join(formats)}, {config.dtype}, KV {config.kv_dtype})"


def evaluate(
    folder: Path, prompts: list[list[int]], reference: list[Continuation], max_new_tokens: int, stop_ids: set[int]
) -> dict[str, Any]:
    engine = Engine.load(folder)
    started = time.perf_counter()
    paths = [c.token_ids for c in reference]
    forced = continue_prompts(
        engine, prompts, lambda i, position, _: paths[i][position], [len(p) for p in paths], stop_ids
    )
    free = continue_prompts(engine, prompts, greedy, [max_new_tokens] * len(prompts), stop_ids)
    divergence = [first_divergence(r.token_ids, f.token_ids) for r, f in zip(reference, free, strict=True)]
    return {
        "engine": str(folder),
        "label": label(engine.config),
        "kv_dtype": engine.config.kv_dtype,
        "kv_bytes_per_token": kv_bytes_per_token(engine.config),
        "weight_formats": sorted(set(engine.config.weight_formats.values())),
        **compare(reference, forced),
        "greedy_identical": sum(d is None for d in divergence),
        "greedy_identical_fraction": sum(d is None for d in divergence) / len(prompts),
        "first_divergence": divergence,
        "seconds": round(time.perf_counter() - started, 1),
    }


def print_table(reference: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(
        f"reference: {reference['label']}, {reference['positions']} positions over {reference['prompts']} prompts, "
        f"KV {reference['kv_bytes_per_token']} bytes a token"
    )
    header = (
        f"{'candidate':<58} {'KV B/token':>10} {'top-1 agree':>11} {'mean KL':>10} {'max KL':>10} "
        f"{'greedy identical':>17}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        identical = f"{row['greedy_identical']}/{len(row['first_divergence'])}"
        print(
            f"{row['label']:<58} {row['kv_bytes_per_token']:>10} {row['top1_agreement']:>11.4f} {row['mean_kl']:>10.2e} {row['max_kl']:>10.2e} "
            f"{identical:>17}"
        )


def check_comparable(reference: EngineConfig, candidate: EngineConfig) -> None:
    if candidate.spec != reference.spec:
        raise SystemExit(f"{candidate.folder} is another model than {reference.folder} (model specs differ)")
    if candidate.source.sha256 != reference.source.sha256:
        print(f"note: {candidate.folder.name} was built from another source file than the reference")


def load_kernels_of(revision: str, config: EngineConfig) -> None:
    """Builds plugins/csrc at `revision` for the reference engine's ISA and loads it as the process's library."""
    import subprocess
    import tarfile
    import tempfile
    from io import BytesIO

    from ifb.plugins import quant_build
    from ifb.runtime.step.kernels import ensure_quant_library

    assert config.kernels is not None, "--kernels needs a block-weight engine"
    root = Path(__file__).resolve().parents[1]
    scratch = Path(tempfile.mkdtemp(prefix="ifb-quality-kernels-"))
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", revision, "plugins/csrc"], capture_output=True, check=True
    )
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(scratch, filter="data")
    quant_build._CSRC = scratch / "plugins" / "csrc"
    library = quant_build.build_quant_library(scratch / "lib", quant_build.QuantIsa(config.kernels.isa))
    ensure_quant_library(library.path, config.kernels.isa, library.required_features)
    print(f"kernels: plugins/csrc at {revision} ({library.path})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, required=True, help="The exact engine (e.g. fp32 KV).")
    parser.add_argument("--candidate", type=Path, action="append", required=True, help="Repeatable.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS), help="Use the first N prompts.")
    parser.add_argument("--output", type=Path, default=Path("bench/out/quality.json"))
    parser.add_argument("--kernels", metavar="REV", help="Run on plugins/csrc as at git revision REV.")
    args = parser.parse_args()
    config = EngineConfig.load(args.reference)
    if args.kernels:
        load_kernels_of(args.kernels, config)
    for folder in args.candidate:
        check_comparable(config, EngineConfig.load(folder, verify=False))
    prompts = chat_prompts(config, args.num_prompts)
    stop_ids = stop_token_ids(config)
    started = time.perf_counter()
    engine = Engine(config)
    reference = continue_prompts(engine, prompts, greedy, [args.max_new_tokens] * len(prompts), stop_ids)
    del engine  # its KV pool: gigabytes for a full-size engine
    summary = {
        "engine": str(args.reference),
        "label": label(config),
        "kv_bytes_per_token": kv_bytes_per_token(config),
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "positions": sum(len(c.token_ids) for c in reference),
        "continuation_tokens": [len(c.token_ids) for c in reference],
        "seconds": round(time.perf_counter() - started, 1),
    }
    rows = [evaluate(folder, prompts, reference, args.max_new_tokens, stop_ids) for folder in args.candidate]
    print_table(summary, rows)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    record = {"max_new_tokens": args.max_new_tokens, "reference": summary, "candidates": rows}
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
