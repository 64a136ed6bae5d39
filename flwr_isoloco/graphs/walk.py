"""Dead vertices and the walk on the live graph (pure networkx / numpy, no Flower).

RW-LoRA's walk must survive vertices that stop answering. Two pieces, both plain maths:

- :class:`VertexHealth`: per-vertex bookkeeping. A vertex whose hop fails ``dead_after``
  consecutive times is marked *dead* and skipped for a back-off of ``backoff`` rounds; each
  further death (a failure right after it comes back) doubles the back-off, up to
  ``backoff_max``. A successful hop forgives everything (streak and back-off reset).
- :func:`live_transition` / :class:`LiveTransitions`: the transition matrix while some vertices
  are dead. The walk moves on the live graph ``L = G - dead`` with its matrix recomputed for the
  same target restricted to the live vertices (Metropolis: ``pi_L = pi|_L / pi(L)``; simple:
  ``pi_L ∝ deg_L``). Where ``L`` is disconnected (a dead cut vertex, or a pendant whose only
  neighbour is dead) the server *relays* the token across the dead part: for every connected
  component ``C`` of dead vertices, every two live neighbours of ``C`` are joined by a relay
  edge. ``H = L + relay edges`` is connected whenever ``G`` is (a path between live vertices
  in ``G`` crosses dead vertices only in runs inside one dead component, whose two live ends
  are relay-joined), so the chain on ``H`` is irreducible with the restricted target as its
  stationary law.

Matrices are n x n over all vertices of ``G`` in :func:`~flwr_isoloco.graphs.vertex_list`
order, so a :class:`~flwr_isoloco.graphs.RandomWalk` keeps its vertex indexing (and its RNG)
while the dead set changes: dead columns are 0 (never entered); a dead vertex's row (used only
when the token's last holder is declared dead) goes to the live neighbours of its dead
component in proportion to the live stationary law, and such a hop also counts as a relay.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from .topology import (
    PeriodicWalkWarning,
    _target_vector,
    restrict_target,
    stationary_distribution,
    transition_matrix,
    vertex_list,
)

__all__ = [
    "LiveMatrix",
    "LiveTransitions",
    "VertexHealth",
    "live_transition",
    "relay_graph",
    "reroute_exclusions",
]


# --------------------------------------------------------------------------- live graph


def relay_graph(G: nx.Graph, dead: Iterable[Any]) -> tuple[nx.Graph, set[frozenset]]:
    """``(H, relays)``: the live graph, plus relay edges when it is disconnected.

    ``L = G[V - dead]``. If ``L`` is connected, ``H = L`` and there are no relays. Otherwise,
    for each connected component ``C`` of ``G[dead]`` with live neighbours ``B(C)``, every pair
    of ``B(C)`` that is not an edge of ``L`` becomes a relay edge (``frozenset({u, w})``).
    Raises ``ValueError`` if every vertex is dead.
    """
    dead = set(dead) & set(G.nodes)
    live = [v for v in vertex_list(G) if v not in dead]
    if not live:
        raise ValueError("every vertex of the graph is dead: nothing to walk on")
    H = G.subgraph(live).copy()
    relays: set[frozenset] = set()
    if nx.is_connected(H):
        return H, relays
    for comp in nx.connected_components(G.subgraph(dead)):
        boundary = sorted(
            {w for d in comp for w in G.neighbors(d) if w not in dead}, key=live.index
        )
        for i, u in enumerate(boundary):
            for w in boundary[i + 1 :]:
                if not H.has_edge(u, w):
                    H.add_edge(u, w)
                    relays.add(frozenset((u, w)))
    if not nx.is_connected(H):  # only possible if G itself is disconnected
        raise ValueError("live graph with relays is disconnected (is the graph connected?)")
    return H, relays


@dataclass(frozen=True)
class LiveMatrix:
    """One dead set's walk: ``P`` (n x n, all vertices), its stationary law ``pi`` (0 on dead
    vertices), the relay edges, and the dead set."""

    P: np.ndarray
    pi: np.ndarray
    relays: frozenset
    dead: frozenset

    def is_relay(self, u: Any, v: Any) -> bool:
        """A hop ``u -> v`` is a relay when it crosses a relay edge or leaves a dead vertex."""
        if u is None or u == v:
            return False
        return u in self.dead or frozenset((u, v)) in self.relays


def live_transition(
    G: nx.Graph,
    dead: Iterable[Any] = (),
    kind: str = "metropolis",
    target: Sequence[float] | Mapping[Any, float] | None = None,
    lazy: bool = False,
) -> LiveMatrix:
    """Transition matrix of the walk on ``H`` (:func:`relay_graph`), embedded in n x n.

    ``target`` is over *all* vertices of ``G`` (as for
    :func:`~flwr_isoloco.graphs.transition_matrix`); it is restricted to the live vertices and
    renormalised. With no dead vertex this is ``transition_matrix(G, kind, target, lazy)``.
    Periodicity is not warned about here (the full graph's check already did).
    """
    verts = vertex_list(G)
    idx = {v: i for i, v in enumerate(verts)}
    dead_set = frozenset(v for v in dead if v in idx)
    H, relays = relay_graph(G, dead_set)
    # the target normalised over G first, then restricted (renormalised by transition_matrix)
    full = None if target is None else _target_vector(G, target)
    sub_target = restrict_target(G, full, H.nodes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PeriodicWalkWarning)
        Q = transition_matrix(H, kind, target=sub_target, lazy=lazy)
    live = vertex_list(H)
    rows = [idx[v] for v in live]
    n = len(verts)
    P = np.zeros((n, n))
    P[np.ix_(rows, rows)] = Q
    pi_live = stationary_distribution(Q)
    pi = np.zeros(n)
    pi[rows] = pi_live
    if dead_set:
        for comp in nx.connected_components(G.subgraph(dead_set)):
            boundary = {w for d in comp for w in G.neighbors(d) if w not in dead_set}
            w = np.array([pi[idx[b]] if b in boundary else 0.0 for b in verts])
            if w.sum() <= 0:  # pragma: no cover - G connected => boundary non-empty
                w = pi.copy()
            for d in comp:
                P[idx[d]] = w / w.sum()
    return LiveMatrix(P=P, pi=pi, relays=frozenset(relays), dead=dead_set)


class LiveTransitions:
    """:func:`live_transition` for a fixed graph / kind / target / laziness, cached per dead set
    (the last ``cache_size`` dead sets; the matrix is a pure function of the dead set, so a
    resumed run recomputes the same one)."""

    def __init__(
        self,
        G: nx.Graph,
        kind: str = "metropolis",
        target: Sequence[float] | Mapping[Any, float] | None = None,
        lazy: bool = False,
        cache_size: int = 64,
    ) -> None:
        self.G, self.kind, self.target, self.lazy = G, kind, target, bool(lazy)
        self.cache_size = int(cache_size)
        self._cache: OrderedDict[frozenset, LiveMatrix] = OrderedDict()

    def get(self, dead: Iterable[Any] = ()) -> LiveMatrix:
        key = frozenset(v for v in dead if v in self.G)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        lm = live_transition(self.G, key, self.kind, self.target, self.lazy)
        self._cache[key] = lm
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return lm


def reroute_exclusions(position: Any, failed: Iterable[Any], dead: Iterable[Any] = ()) -> set:
    """Vertices a re-route must not draw: the self-loop (``position``), the vertices that already
    failed this round, and the dead ones. The remaining row is renormalised by the draw."""
    out = set(failed) | set(dead)
    if position is not None:
        out.add(position)
    return out


# --------------------------------------------------------------------------- health


class VertexHealth:
    """Consecutive-failure counts and back-off of dead vertices (rounds are ints).

    - :meth:`record_failure` ``(v, r)``: ``streak_v += 1``; at ``streak_v >= dead_after`` the
      vertex dies: ``strikes_v += 1`` and it is dead for rounds ``r .. r + b`` with
      ``b = min(backoff * 2**(strikes_v - 1), backoff_max)``; its streak is left at
      ``dead_after - 1``, so one failure after it comes back kills it again with twice the
      back-off. Returns ``b`` when the vertex just died, else ``None``.
    - :meth:`record_success` ``(v)``: streak and strikes back to 0.
    - ``dead_after = 0`` turns the mechanism off (no vertex is ever dead).
    """

    def __init__(self, dead_after: int = 2, backoff: int = 8, backoff_max: int = 128) -> None:
        for name, value, lo in (
            ("dead_after", dead_after, 0),
            ("backoff", backoff, 1),
            ("backoff_max", backoff_max, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
        if backoff_max < backoff:
            raise ValueError(f"backoff_max ({backoff_max}) must be >= backoff ({backoff})")
        self.dead_after, self.backoff, self.backoff_max = (
            int(dead_after),
            int(backoff),
            int(backoff_max),
        )
        self.streak: dict[Any, int] = {}
        self.strikes: dict[Any, int] = {}
        self.dead_until: dict[Any, int] = {}  # dead for rounds <= dead_until[v]

    def dead(self, server_round: int) -> set:
        """Vertices dead in ``server_round``."""
        return {v for v, until in self.dead_until.items() if server_round <= until}

    def record_failure(self, v: Any, server_round: int) -> int | None:
        if not self.dead_after:
            return None
        self.streak[v] = self.streak.get(v, 0) + 1
        if self.streak[v] < self.dead_after:
            return None
        self.strikes[v] = self.strikes.get(v, 0) + 1
        period = min(self.backoff * 2 ** (self.strikes[v] - 1), self.backoff_max)
        self.dead_until[v] = server_round + period
        self.streak[v] = self.dead_after - 1
        return period

    def record_success(self, v: Any) -> None:
        self.streak.pop(v, None)
        self.strikes.pop(v, None)
        self.dead_until.pop(v, None)

    def state_dict(self) -> dict[str, list]:
        """JSON-able: lists of ``[vertex, value]`` pairs (vertices keep their int / str type)."""
        return {
            name: [[v, int(n)] for v, n in getattr(self, name).items()]
            for name in ("streak", "strikes", "dead_until")
        }

    def load_state_dict(self, state: Mapping[str, Any], vertices: Iterable[Any]) -> None:
        known = set(vertices)
        loaded: dict[str, dict[Any, int]] = {}
        try:
            for name in ("streak", "strikes", "dead_until"):
                pairs = {}
                for v, n in state[name]:
                    if v not in known or isinstance(n, bool) or not isinstance(n, int):
                        raise ValueError(f"{name}: bad entry {[v, n]!r}")
                    pairs[v] = n
                loaded[name] = pairs
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"VertexHealth.load_state_dict: bad state ({e})") from None
        self.streak, self.strikes, self.dead_until = (
            loaded["streak"],
            loaded["strikes"],
            loaded["dead_until"],
        )
