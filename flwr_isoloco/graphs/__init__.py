"""The client graph of the graph strategies (RW-LoRA, gossip LoRA), pure maths: no Flower.

- ``specs.py``: a graph from its spec string (``"ring"``, ``"erdos_renyi:p=0.3"``, a file).
- ``topology.py``: the graph and its walks: :func:`build_graph`, transition matrices
  (:func:`transition_matrix`, :class:`RandomWalk`), stationary distributions, spectral gaps,
  Metropolis mixing weights (:func:`metropolis_mixing_weights`, :func:`mix`).
- ``walk.py``: a walk over a graph whose vertices fail: live transitions, vertex health,
  re-routing around dead vertices.
"""

from .topology import (
    GRAPH_KINDS,
    TRANSITION_KINDS,
    PeriodicWalkWarning,
    RandomWalk,
    build_graph,
    consensus_distance,
    deferred_graph,
    metropolis_mixing_weights,
    mix,
    parse_spec,
    restrict_target,
    spectral_gap,
    stationary_distribution,
    subgraph_transition,
    total_variation,
    transition_matrix,
    vertex_index,
    vertex_list,
)
from .walk import (
    LiveMatrix,
    LiveTransitions,
    VertexHealth,
    live_transition,
    relay_graph,
    reroute_exclusions,
)

__all__ = [
    "GRAPH_KINDS",
    "TRANSITION_KINDS",
    "LiveMatrix",
    "LiveTransitions",
    "PeriodicWalkWarning",
    "RandomWalk",
    "VertexHealth",
    "build_graph",
    "consensus_distance",
    "deferred_graph",
    "live_transition",
    "metropolis_mixing_weights",
    "mix",
    "parse_spec",
    "relay_graph",
    "reroute_exclusions",
    "restrict_target",
    "spectral_gap",
    "stationary_distribution",
    "subgraph_transition",
    "total_variation",
    "transition_matrix",
    "vertex_index",
    "vertex_list",
]
