"""The Ray Serve RequestRouter over `fleet.kv_router.rank_replicas` (this module imports Ray)."""

from __future__ import annotations

import time

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from fleet.kv_router import NEED_TOKENS_KWARG, ReplicaKV, rank_replicas, with_inflight


def _need(pending_request: PendingRequest | None) -> int:
    kwargs = pending_request.kwargs if pending_request is not None else {}
    return max(1, int(kwargs.get(NEED_TOKENS_KWARG, 1)))


class KVAwareRequestRouter(FIFOMixin, RequestRouter):
    """One replica per rank, best first; replicas that cannot admit are offered only when none can."""

    def initialize_state(self, **kwargs) -> None:
        self._inflight: dict[ReplicaID, dict[str, tuple[float, int]]] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        loads = []
        for r in candidate_replicas:
            stats = r.routing_stats or {}
            loads.append(with_inflight(ReplicaKV.from_stats(stats), float(stats.get("time", 0.0)),
                                       self._inflight.get(r.replica_id, {})))
        return [[candidate_replicas[i]] for i in rank_replicas(loads, _need(pending_request))]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        replica = self._replicas.get(replica_id)
        load = ReplicaKV.from_stats(replica.routing_stats if replica is not None else None)
        need = _need(pending_request)
        blocks = load.blocks_for(need) if load is not None else -(-need // 16)
        self._inflight.setdefault(replica_id, {})[pending_request.metadata.internal_request_id] = (time.time(), blocks)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._inflight.get(replica_id, {}).pop(internal_request_id, None)
