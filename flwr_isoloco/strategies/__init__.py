"""Server-side Flower strategies (Message API), all with one lifecycle
(:class:`~flwr_isoloco.strategies.lifecycle.ResumableStrategy`: resumable ``start`` with global
round numbers and an ``on_round_end`` hook).

- :class:`DiLoCo` (``diloco.py``), :class:`IsoLoCo` (``isoloco.py``): merge pseudo-gradients + outer optimiser.
- :class:`RWLoRA` (``rwlora.py``): one adapter walks the client graph, one node per round.
- :class:`GossipLoRA` (``gossip.py``): decentralised-SGD baseline with Metropolis mixing.
- :func:`wait_for_nodes` (``nodes.py``): the one node-waiting helper.
"""

from .diloco import DiLoCo
from .gossip import GossipLoRA
from .isoloco import IsoLoCo
from .lifecycle import ResumableStrategy, RoundOutcome
from .nodes import NodeWaitError, wait_for_nodes
from .rwlora import RWLoRA

__all__ = [
    "DiLoCo",
    "GossipLoRA",
    "IsoLoCo",
    "NodeWaitError",
    "RWLoRA",
    "ResumableStrategy",
    "RoundOutcome",
    "wait_for_nodes",
]
