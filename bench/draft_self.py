"""The draft-engine method on the bundled model, with the engine as its own draft (the only model
here): greedy acceptance must be 100%, and the planner, pricing each draft at the draft engine's
own cost model, should decline drafts that cost as much as the steps they save.

    .venv/bin/python bench/draft_self.py --engine ENGINE [--max-tokens 64]

Three runs of one greedy request (warmed once each): speculation off; `draft` with the cost
model (the planner decides); `draft` with every proposal verified (no cost model: the mechanics).
Prints tokens/s, drafts, drafted and accepted tokens, and steps; the texts must be equal.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ifb import LLM, SamplingParams
from ifb.runtime.step_budget.budgets import FixedBudget

PROMPT = "Rewrite this sentence in the passive voice: The quick brown fox jumps over the lazy dog. Then repeat it."


def measure(engine: str, max_tokens: int, always_draft: bool, **settings: Any) -> dict[str, Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with LLM(engine, **settings) as llm:
        if always_draft:
            llm.executor.scheduler.step_budget = FixedBudget()
        ids = llm.tokenize(PROMPT)
        llm.generate([ids], params)
        start = time.perf_counter()
        output = llm.generate([ids], params)[0]
        elapsed = time.perf_counter() - start
        counters = llm.stats().counters
    return {
        "tok_s": max_tokens / elapsed,
        "drafts": counters.spec_num_drafts,
        "draft_tokens": counters.spec_num_draft_tokens,
        "accepted": counters.spec_num_accepted_tokens,
        "steps": counters.num_steps,
        "text": output.text,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    draft = {"speculative": "draft", "draft_engine": args.engine}
    runs = {
        "off": measure(args.engine, args.max_tokens, False),
        "draft (planner)": measure(args.engine, args.max_tokens, False, **draft),
        "draft (always)": measure(args.engine, args.max_tokens, True, **draft),
    }
    print("| run | tok/s | drafts | drafted | accepted | steps (both requests) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in runs.items():
        print(f"| {name} | {r['tok_s']:.1f} | {r['drafts']} | {r['draft_tokens']} | {r['accepted']} | {r['steps']} |")
    texts = {r["text"] for r in runs.values()}
    print("greedy texts equal:", len(texts) == 1)


if __name__ == "__main__":
    main()
