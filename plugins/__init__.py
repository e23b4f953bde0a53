"""ifb.plugins: paged attention and KV-write ops, a pure-torch reference and the fast path."""
