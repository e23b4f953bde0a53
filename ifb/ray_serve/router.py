"""PrefixAffinityRouter: Ray Serve's request-router extension point, routing by prefix then load.

Serve builds one router per deployment handle, in the caller's process (here the ingress), and
calls `choose_replicas` with the pending request's own arguments: the prompt token ids are right
there, so nothing is serialized to route. Each rank returned holds one replica, so Serve's own
queue-length pick among a rank cannot override ours; it only skips a replica past its
max_ongoing_requests (set above the engine's admission limit in deploy.py: the engine refuses
first, with a 429 the ingress can retry elsewhere).

Loads come from each replica's routing stats (replica.py, pushed through Serve's controller every
request_routing_stats_period_s) together with this router's own count of requests in flight
per replica, which is fresh between reports. The ingress reads the same stats for /health and
/metrics through `affinity.router_for`.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ifb.ray_serve.affinity import (
    MAX_AFFINITY_BLOCKS,
    InFlightLedger,
    PrefixAffinity,
    ReplicaLoad,
    rank_replicas,
    register_router,
)
from ifb.ray_serve.report import ReplicaReport, ReplicaView

logger = logging.getLogger(__name__)

ROUTED_METHOD = "generate"  # the replica method whose first argument is the list of jobs
_UNREPORTED_CAPACITY = 1 << 30  # a replica that has not reported yet counts as open


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, max_blocks: int = MAX_AFFINITY_BLOCKS, **_: Any) -> None:
        self.affinity = PrefixAffinity(block_size, max_blocks)
        self._in_flight = InFlightLedger()
        register_router(self._deployment_id.name, self)

    def replica_views(self) -> dict[str, ReplicaView]:
        """Every replica Serve considers running, by replica id: its latest report and this
        router's count of requests in flight on it."""
        return {
            r.replica_id.unique_id: ReplicaView(
                ReplicaReport.from_stats(r.routing_stats), self._in_flight.count(r.replica_id.unique_id)
            )
            for r in self._replicas_list
        }

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        name = replica.replica_id.unique_id
        report = ReplicaReport.from_stats(replica.routing_stats)
        if report is None:  # not reported yet: open, with what this router sent it
            return ReplicaLoad(name, 0, 0, _UNREPORTED_CAPACITY, self._in_flight.count(name))
        capacity = report.capacity if report.ok else 0
        return ReplicaLoad(name, report.num_running, report.num_waiting, capacity, self._in_flight.count(name))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        if pending_request is None or pending_request.metadata.call_method != ROUTED_METHOD:
            loads = [self._load(r) for r in candidate_replicas]
            return [[by_name[name]] for name in rank_replicas(loads, None)]
        avoid = set(pending_request.kwargs.get("avoid", ()))
        loads = [self._load(r) for r in candidate_replicas if r.replica_id.unique_id not in avoid]
        if not loads:  # every replica refused once already: let the least loaded refuse again
            loads = [self._load(r) for r in candidate_replicas]
        token_ids, params = pending_request.args[0][0]
        keys = self.affinity.keys(token_ids, params.cache_salt)
        preferred, num_blocks = self.affinity.lookup(keys)
        ranked = rank_replicas(loads, preferred)
        self._in_flight.chosen(pending_request.metadata.internal_request_id, ranked[0], keys)
        logger.debug(
            "route %s: prefix %d blocks on %s, ranked %s",
            pending_request.metadata.request_id,
            num_blocks,
            preferred,
            ranked,
        )
        return [[by_name[name]] for name in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        keys = self._in_flight.routed(pending_request.metadata.internal_request_id, replica_id.unique_id)
        if keys is not None:
            self.affinity.remember(keys, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.replica_id.unique_id for r in self._replicas_list}
        super().update_replicas(replicas)
        for name in before - {r.replica_id.unique_id for r in replicas}:
            self._forget(name)

    def _forget(self, name: str) -> None:
        self.affinity.forget(name)
        self._in_flight.forget(name)
