"""ifb.cli: the `ifb` command (build, run, bench)."""
