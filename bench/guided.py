"""Guided decoding cost: a batch of 16 where half are JSON-schema guided vs none guided.

.venv/bin/python bench/guided.py [--engine ENGINE_DIR] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ifb import LLM, SamplingParams
from ifb.builder.build import BuildOptions
from ifb.find_or_build import find_or_build_engine
from ifb.runtime.guided import GuidedDecoding

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
}


def run(llm: LLM, guided_half: bool, max_tokens: int) -> tuple[float, int]:
    prompts = [
        llm.apply_chat_template([{"role": "user", "content": f"Describe person number {i} as JSON."}])
        for i in range(16)
    ]
    params = []
    for i in range(16):
        guide = GuidedDecoding.json_schema(SCHEMA) if guided_half and i % 2 == 0 else None
        params.append(
            SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i, ignore_eos=guide is None, guided=guide)
        )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    # Compare like for like: tokens per second over everything generated.
    return wall, sum(len(o.token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default=None)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    engine = Path(args.engine or find_or_build_engine(None, BuildOptions(max_batch_size=32, max_num_tokens=512)))
    with LLM(engine, max_batch_size=16) as llm:
        run(llm, True, 4)  # warm-up: compiles the grammar once
        plain_wall, plain_tokens = run(llm, False, args.max_tokens)
        guided_wall, guided_tokens = run(llm, True, args.max_tokens)
        stats = llm.stats()
    plain, guided = plain_tokens / plain_wall, guided_tokens / guided_wall
    print(f"none guided: {plain_tokens} tokens in {plain_wall:.2f}s = {plain:.1f} tok/s")
    print(f"half guided: {guided_tokens} tokens in {guided_wall:.2f}s = {guided:.1f} tok/s")
    print(f"throughput cost of guiding half the batch: {100 * (1 - guided / plain):.1f}%")
    print(
        f"grammar compiles: {stats.guided.num_requests}, total {stats.guided.compile_seconds_total:.3f}s, max {stats.guided.compile_seconds_max:.3f}s"
    )


if __name__ == "__main__":
    main()
