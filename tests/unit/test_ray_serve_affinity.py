"""Prefix-affinity routing decisions (ifb/ray_serve/affinity.py), without Ray."""

from __future__ import annotations

import random

from ifb.ray_serve.affinity import InFlightLedger, PrefixAffinity, ReplicaLoad, rank_replicas


def load(name: str, running: int = 0, waiting: int = 0, capacity: int = 10, in_flight: int = 0) -> ReplicaLoad:
    return ReplicaLoad(name, running, waiting, capacity, in_flight)


def test_longest_remembered_prefix_names_the_replica() -> None:
    """A prompt sharing two full blocks with one routed earlier maps to that replica."""
    affinity = PrefixAffinity(block_size=4)
    affinity.remember(affinity.keys(list(range(9)), None), "r0")
    assert affinity.lookup(affinity.keys(list(range(8)) + [50, 51, 52, 53], None)) == ("r0", 2)
    assert affinity.lookup(affinity.keys([50] + list(range(1, 12)), None)) == (None, 0)


def test_salt_separates_tenants() -> None:
    """The same tokens under another cache_salt do not match (the KV manager's keys)."""
    affinity = PrefixAffinity(block_size=4)
    affinity.remember(affinity.keys(list(range(8)), "a"), "r0")
    assert affinity.lookup(affinity.keys(list(range(8)), "b")) == (None, 0)


def test_forget_and_lru_bound() -> None:
    affinity = PrefixAffinity(block_size=4, max_keys=3)
    affinity.remember(affinity.keys(list(range(16)), None), "r0")
    assert len(affinity) == 3
    affinity.forget("r0")
    assert len(affinity) == 0


def test_preferred_replica_first_unless_full() -> None:
    loads = [load("r0", running=5), load("r1")]
    assert rank_replicas(loads, "r0", random.Random(0))[0] == "r0"
    full = [load("r0", running=6, waiting=4), load("r1")]
    assert rank_replicas(full, "r0", random.Random(0)) == ["r1"]


def test_power_of_two_picks_the_less_loaded() -> None:
    loads = [load("r0", running=3), load("r1", running=1)]
    for seed in range(5):
        assert rank_replicas(loads, None, random.Random(seed))[0] == "r1"


def test_in_flight_counts_between_reports() -> None:
    """Requests this router sent since the last report count as load."""
    loads = [load("r0", in_flight=4), load("r1", running=2)]
    assert rank_replicas(loads, None, random.Random(0))[0] == "r1"


def test_all_full_ranks_every_replica_by_load() -> None:
    """No replica has room: the least loaded is tried (its engine refuses: a 429)."""
    loads = [load("r0", running=10, waiting=2), load("r1", running=10)]
    assert rank_replicas(loads, "r0", random.Random(0)) == ["r1", "r0"]


def test_a_burst_chosen_before_any_is_routed_spreads() -> None:
    """Serve chooses for a whole burst before routing any request: each choice counts at once,
    so a stale snapshot (r0 one running) cannot send the whole burst to r1."""
    ledger = InFlightLedger()
    picks = []
    for i in range(12):
        loads = [load("r0", running=1, in_flight=ledger.count("r0")), load("r1", in_flight=ledger.count("r1"))]
        picks.append(rank_replicas(loads, None, random.Random(i))[0])
        ledger.chosen(f"q{i}", picks[-1], [])
    assert sorted(picks.count(r) for r in ("r0", "r1")) == [6, 6]
    assert ledger.count("r0") + ledger.count("r1") == 12


def test_ledger_moves_a_choice_to_where_it_was_routed_and_counts_it_out() -> None:
    ledger = InFlightLedger(max_pending=2)
    ledger.chosen("a", "r0", [b"k"])
    ledger.chosen("a", "r1", [b"k"])  # Serve chose again for the same request
    assert (ledger.count("r0"), ledger.count("r1")) == (0, 1)
    assert ledger.routed("a", "r0") == [b"k"]  # r1 refused; r0 took it
    assert (ledger.count("r0"), ledger.count("r1")) == (1, 0)
    assert ledger.routed("a", "r0") is None
    ledger.completed("a")
    assert ledger.count("r0") == 0
    for name in ("b", "c", "d"):  # never routed (cancelled): the oldest choice ages out
        ledger.chosen(name, "r1", [])
    assert ledger.count("r1") == 2
    ledger.forget("r1")
    assert ledger.count("r1") == 0 and ledger.routed("c", "r1") is None
