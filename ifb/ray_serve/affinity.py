"""Which replica a request goes to: the one already holding its prompt's prefix, else the
less-loaded of two sampled replicas (power of two choices); a replica at its admission limit is
skipped. Plain Python, no Ray: router.py feeds it Serve's replicas, tests feed it by hand.

Prefix keys are the KV manager's own (runtime/prefix_hash.py): SHA-256 chained over full blocks,
salted by cache_salt. A chain key names the whole prefix up to its block, so the longest
remembered key of a prompt names the replica holding the most of it. Worked example,
block_size 4, prompts sharing their first 8 tokens:

    A = [system(8) | question 1(5)]  keys k1 k2      -> no match; p2c picks r0; remember k1 k2 -> r0
    B = [system(8) | question 2(6)]  keys k1 k2 (k3) -> k2 -> r0 (unless r0 is full)
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ifb.runtime.prefix_hash import prefix_block_keys

MAX_AFFINITY_BLOCKS = 32  # blocks hashed per prompt: enough to tell prefixes apart, bounded cost
_RNG = random.Random()
MAX_REMEMBERED_KEYS = 200_000  # ~10 MB of keys; least recently routed are forgotten first


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's load as the router sees it. `num_running`/`num_waiting` come from the
    replica's last published snapshot; `num_in_flight` is what this router sent it and has not
    seen finish, which is fresher between snapshots."""

    replica: str
    num_running: int
    num_waiting: int
    capacity: int  # max_batch_size + max_queued_requests: the engine's admission limit
    num_in_flight: int = 0

    @property
    def load(self) -> int:
        return max(self.num_running + self.num_waiting, self.num_in_flight)

    @property
    def is_full(self) -> bool:
        return self.load >= self.capacity


class PrefixAffinity:
    """Remembers which replica each prefix block key was routed to (an LRU of keys)."""

    def __init__(
        self, block_size: int, max_blocks: int = MAX_AFFINITY_BLOCKS, max_keys: int = MAX_REMEMBERED_KEYS
    ) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_keys = max_keys
        self._owner: OrderedDict[bytes, str] = OrderedDict()

    def keys(self, token_ids: Sequence[int], salt: str | None) -> list[bytes]:
        """Keys of the prompt's first full blocks (at most max_blocks)."""
        head = token_ids[: self.block_size * self.max_blocks]
        return prefix_block_keys(head, self.block_size, salt)

    def lookup(self, keys: Sequence[bytes]) -> tuple[str | None, int]:
        """(replica holding the longest remembered prefix, its length in blocks), or (None, 0)."""
        for i in range(len(keys) - 1, -1, -1):
            owner = self._owner.get(keys[i])
            if owner is not None:
                return owner, i + 1
        return None, 0

    def remember(self, keys: Sequence[bytes], replica: str) -> None:
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_keys:
            self._owner.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop a replica that died: its replacement starts with an empty cache."""
        for key in [k for k, owner in self._owner.items() if owner == replica]:
            del self._owner[key]

    def __len__(self) -> int:
        return len(self._owner)


class InFlightLedger:
    """Requests this router sent each replica and has not seen finish, counted from the moment a
    replica is chosen. Serve calls choose_replicas for a whole burst before it routes any of
    them; counting only routed requests let every request of the burst see the same stale
    snapshot and pick the same replica (CI: 11 of 12 concurrent requests on one of two replicas).
    A chosen request counts on its first-ranked replica until Serve says where it went."""

    def __init__(self, max_pending: int = 4096) -> None:
        self.max_pending = max_pending  # chosen but never routed (cancelled) requests age out
        self._chosen: OrderedDict[str, tuple[str, list[bytes]]] = OrderedDict()
        self._routed: dict[str, str] = {}
        self._counts: dict[str, int] = {}

    def count(self, replica: str) -> int:
        return self._counts.get(replica, 0)

    def chosen(self, request_id: str, replica: str, keys: list[bytes]) -> None:
        """`replica` ranked first for the request; a re-choice (Serve retrying) replaces it."""
        self._drop_choice(request_id)
        self._chosen[request_id] = (replica, keys)
        self._add(replica, 1)
        while len(self._chosen) > self.max_pending:
            self._drop_choice(next(iter(self._chosen)))

    def routed(self, request_id: str, replica: str) -> list[bytes] | None:
        """The request went to `replica`: its prefix keys, or None if it was not chosen here."""
        choice = self._chosen.pop(request_id, None)
        if choice is None:
            return None
        self._add(choice[0], -1)
        self._routed[request_id] = replica
        self._add(replica, 1)
        return choice[1]

    def completed(self, request_id: str) -> None:
        replica = self._routed.pop(request_id, None)
        if replica is not None:
            self._add(replica, -1)

    def forget(self, replica: str) -> None:
        """A replica that died: what was sent to it no longer counts anywhere."""
        self._counts.pop(replica, None)
        for request_id in [r for r, (name, _) in self._chosen.items() if name == replica]:
            del self._chosen[request_id]
        for request_id in [r for r, name in self._routed.items() if name == replica]:
            del self._routed[request_id]

    def _drop_choice(self, request_id: str) -> None:
        choice = self._chosen.pop(request_id, None)
        if choice is not None:
            self._add(choice[0], -1)

    def _add(self, replica: str, delta: int) -> None:
        if replica in self._counts or delta > 0:
            self._counts[replica] = max(0, self._counts.get(replica, 0) + delta)


def rank_replicas(loads: Sequence[ReplicaLoad], preferred: str | None, rng: random.Random | None = None) -> list[str]:
    """Replica ids, most preferred first: the prefix holder if it has room, then the less loaded
    of two sampled replicas with room, then the other replicas with room by load. When every
    replica is full, all of them by load: the least loaded one's engine then refuses (a 429)
    unless a seat freed since its last snapshot."""
    open_loads = [r for r in loads if not r.is_full]
    if not open_loads:
        return [r.replica for r in sorted(loads, key=lambda r: r.load)]
    ranked: list[str] = []
    if preferred is not None and any(r.replica == preferred for r in open_loads):
        ranked.append(preferred)
    pair = (rng or _RNG).sample(open_loads, min(2, len(open_loads)))
    best = min(pair, key=lambda r: r.load).replica
    if best not in ranked:
        ranked.append(best)
    ranked += [r.replica for r in sorted(open_loads, key=lambda r: r.load) if r.replica not in ranked]
    return ranked


# Serve pickles a request-router class by value, so a class attribute would live on a copy of
# the class: the routers of this process are registered here, in a module imported by name.
_ROUTERS: dict[str, Any] = {}


def register_router(deployment: str, router: Any) -> None:
    _ROUTERS[deployment] = router


def router_for(deployment: str) -> Any | None:
    """This process's router for `deployment` (None until a handle to it sent a request)."""
    return _ROUTERS.get(deployment)
