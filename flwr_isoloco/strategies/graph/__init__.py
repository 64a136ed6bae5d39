"""The graph family: :class:`RWLoRA` (``rwlora``: one adapter random-walks the client graph,
with its hops, state and variants in ``rwlora_*``) and :class:`GossipLoRA` (``gossip``), on
one base (``base``: graph, vertex discovery in ``vertices``, the round and its guards), which
takes DiLoCo's ``ReplyChecks`` / ``Rounds`` (``settings``: the fields a graph does not use)."""

from flwr_isoloco.strategies.graph.base import GraphStrategy
from flwr_isoloco.strategies.graph.gossip import GossipLoRA
from flwr_isoloco.strategies.graph.rwlora import RWLoRA

__all__ = ["GossipLoRA", "GraphStrategy", "RWLoRA"]
