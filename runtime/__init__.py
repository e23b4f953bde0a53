"""ifb.runtime: loads an engine and schedules every step (in-flight batching)."""
