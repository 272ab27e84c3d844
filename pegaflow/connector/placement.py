"""Where an engine's KV shards are stored: on one node, or on one node per group of TP ranks.

``pegaflow.tp_shard_endpoints`` (the original's key) names one node per equal contiguous
group of TP ranks, in rank order: with ``E`` nodes and TP size ``T``, ranks
``[g*T/E, (g+1)*T/E)`` use node ``g`` (each rank can map only its own host's pool). A
**place** is one KV shard on one node: every shard a group's ranks hold has a place on that
group's node. Ordinary attention splits its KV heads over the ranks, so each shard has one
place; a shard whose ranks span groups (MLA's latent, replicated on every rank, or KV heads
replicated across ranks) has a place on each of their nodes, under the shard's one namespace
(the bytes are the same on every rank that holds it).

Contracts:

* Places are ordered by node, then shard. With one node the places are the shards in shard
  order (place ``i`` is shard ``i``), so the single-node path is unchanged.
* A rank copies to and from its own place only (``place_of_rank``); exactly one rank writes
  each place (``writes``): the first rank of its shard in its group.
* A hit needs every place (every shard on every node that serves one).
"""

from __future__ import annotations

from dataclasses import dataclass

from pegaflow.core.identity import KVIdentity

TP_SHARD_ENDPOINTS = "pegaflow.tp_shard_endpoints"


@dataclass(frozen=True, slots=True)
class Place:
    shard: int
    node: int


@dataclass(frozen=True)
class Placement:
    """The places of one engine's KV shards over ``nodes`` nodes (see the module docstring)."""

    tp_size: int
    nodes: int
    places: tuple[Place, ...]
    shard_of: tuple[int, ...]  # TP rank -> KV shard (``KVIdentity.shard_of_rank``)

    @classmethod
    def of(cls, identity: KVIdentity, nodes: int = 1) -> Placement:
        """The placement of ``identity``'s shards over ``nodes`` nodes. Raises ``ValueError``
        (the original's message) unless the TP size divides evenly by the nodes."""
        tp = identity.tp_size
        if nodes < 1 or tp % nodes:
            raise ValueError(f"tensor_parallel_size={tp} must be divisible by the {nodes} PegaFlow TP shards")
        shard_of = tuple(identity.shard_of_rank(r) for r in range(tp))
        per_node = tp // nodes
        places = tuple(dict.fromkeys(Place(shard_of[r], r // per_node) for r in range(tp)))
        return cls(tp_size=tp, nodes=nodes, places=places, shard_of=shard_of)

    def node_of_rank(self, rank: int) -> int:
        """The node (index into the endpoints) TP rank ``rank`` uses."""
        return rank // (self.tp_size // self.nodes)

    def place_of_rank(self, rank: int) -> int:
        """The place TP rank ``rank`` copies to and from."""
        return self.places.index(Place(self.shard_of[rank], self.node_of_rank(rank)))

    def writes(self, rank: int) -> bool:
        """Whether TP rank ``rank`` writes its place (exactly one rank per place does)."""
        place = self.place_of_rank(rank)
        return min(r for r in range(self.tp_size) if self.place_of_rank(r) == place) == rank

    def on_node(self, node: int) -> tuple[int, ...]:
        """The places stored on ``node``, in place order."""
        return tuple(i for i, p in enumerate(self.places) if p.node == node)


def check_tp_only(nodes: int, tp_size: int, world_size: int, dcp_size: int, pcp_size: int) -> None:
    """Several nodes support TP-only parallelism, as in the original (its message): raises
    ``ValueError`` for pipeline, decode- or prefill-context parallelism next to them."""
    if nodes > 1 and (world_size != tp_size or dcp_size != 1 or pcp_size != 1):
        raise ValueError(
            f"{TP_SHARD_ENDPOINTS} currently supports TP-only parallelism; "
            f"got tp_size={tp_size}, world_size={world_size}, "
            f"dcp_world_size={dcp_size}, pcp_world_size={pcp_size}"
        )
