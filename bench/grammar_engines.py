"""xgrammar vs llguidance on this machine: grammar compile time and per-token mask time for the
SmolLM2 tokenizer, a JSON schema, walking the same valid output token by token.

    .venv/bin/python bench/grammar_engines.py      (needs `pip install llguidance` for the comparison)
"""

from __future__ import annotations

import json
import statistics
import time

from ifb.builder.sources import load_model, resolve_source

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"]}, separators=(",", ":"))


def bench_xgrammar(tokenizer, vocab: int, tokens: list[int]) -> tuple[float, float]:
    import torch
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    start = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - start
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for token in tokens:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - t)
        assert matcher.accept_token(token), "xgrammar rejected the valid text"
    del torch
    return compile_s, statistics.median(times)


def bench_llguidance(tokenizer, vocab: int, tokens: list[int]) -> tuple[float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - start
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times = []
    for token in tokens:
        t = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        times.append(time.perf_counter() - t)
        assert matcher.consume_token(token), f"llguidance rejected the valid text: {matcher.get_error()}"
    return compile_s, statistics.median(times)


def main() -> None:
    loaded = load_model(resolve_source(None))
    tokenizer, vocab = loaded.tokenizer, loaded.hf_config.vocab_size
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        try:
            compile_s, mask_s = fn(tokenizer, vocab, tokens)
        except ImportError:
            print(f"{name}: not installed")
            continue
        print(
            f"{name:11s} compile {1000 * compile_s:8.1f} ms   mask per token (median) {1e6 * mask_s:8.1f} us   over {len(tokens)} tokens"
        )


if __name__ == "__main__":
    main()
