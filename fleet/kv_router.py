"""KV-aware replica choice: the pure ranking, and the Ray Serve RequestRouter that applies it.

Each replica reports (`record_routing_stats`) its KV blocks, the blocks its running and waiting
requests have reserved (prompt + max_tokens each) and its waiting queue. A request goes to the
replica with the most KV left after admitting it; a replica that cannot admit it is never offered
while another can. Requests this router sent since a replica's last report count against it, so two
requests in one stats period do not both see the same free blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NEED_TOKENS_KWARG = "need_tokens"  # the replica method's keyword argument: prompt + max_tokens


@dataclass(frozen=True)
class ReplicaKV:
    """What one replica reported: KV blocks in all, blocks its requests reserve, requests waiting."""

    num_blocks: int
    reserved_blocks: int
    num_waiting: int
    block_size: int = 16

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.reserved_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def admits(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= self.free_blocks

    @classmethod
    def from_stats(cls, stats: dict | None) -> ReplicaKV | None:
        try:
            return cls(int(stats["num_blocks"]), int(stats["reserved_blocks"]), int(stats["num_waiting"]),
                       int(stats.get("block_size", 16)))
        except (KeyError, TypeError, ValueError):
            return None


def rank_replicas(loads: Sequence[ReplicaKV | None], need_tokens: int) -> list[int]:
    """Indices in preference order. Replicas that admit `need_tokens` come first, most free KV after
    admission first (fewer waiting breaks ties); when any admits, the others are left out. Replicas
    with no report yet (just started) follow the admitting ones. When none admits, every replica,
    shortest waiting queue first, so the request waits where it will start soonest."""
    admit = [i for i, r in enumerate(loads) if r is not None and r.admits(need_tokens)]
    unknown = [i for i, r in enumerate(loads) if r is None]
    if admit:
        admit.sort(key=lambda i: (-(loads[i].free_blocks - loads[i].blocks_for(need_tokens)),
                                  loads[i].num_waiting, i))
        return admit + unknown
    if unknown:
        return unknown
    return sorted(range(len(loads)), key=lambda i: (loads[i].num_waiting, -loads[i].free_blocks, i))


def with_inflight(load: ReplicaKV | None, reported_at: float, inflight: dict[str, tuple[float, int]]) -> ReplicaKV | None:
    """A replica's report plus the blocks of requests routed to it after that report was taken."""
    if load is None:
        return None
    extra = sum(blocks for sent_at, blocks in inflight.values() if sent_at >= reported_at)
    return ReplicaKV(load.num_blocks, load.reserved_blocks + extra, load.num_waiting, load.block_size)
