"""Speculative decoding inside the in-flight batch (docs/design.md §4).

A proposer guesses a decoding request's next tokens from text it has seen (its own prompt and
output, or recent requests'); the planner decides, from the step budget's cost model and each
request's running acceptance rate, how many of them a step can afford; they run as extra rows of
the request in the same packed step as every other decode and prefill; verification keeps the
longest prefix the target model would have produced itself and one token more.

    config.py          SpeculativeMethod, SpeculativeConfig (and vLLM's --speculative-config)
    prompt_lookup.py   the n-gram match over one token sequence (PromptLookupProposer)
    suffix_cache.py    the same over a bounded cache of recent requests, per cache_salt
    draft_model.py     greedy drafts from a second compiled engine with the same tokenizer
    planner.py         how many draft tokens each request gets this step (SpeculationPlanner)
    verification.py    which drafted tokens are kept, and the seeded generator rewound to match
    factory.py         the one place the method is branched on
"""
