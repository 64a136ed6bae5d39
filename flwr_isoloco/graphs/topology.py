"""Client graphs and random walks over them (pure networkx / numpy, no Flower).

Vertices are client names: ints (a client's ``partition-id``) or strings (a site name). Every
matrix and vector here is indexed by :func:`vertex_list` (ints ascending, then strings).

- :func:`build_graph` (in :mod:`flwr_isoloco.graphs.specs`, imported here): a connected
  ``networkx.Graph`` from a spec (``complete``, ``ring``,
  ``star``, ``erdos_renyi:p=0.3``, ``random_regular:d=3``, ``"0-1,1-2,2-0"``, an edge-list
  file, or a graph).
- :func:`transition_matrix`: ``simple`` (``P_ij = 1/d_i``) or ``metropolis`` towards a target
  ``pi`` (``P_ij = (1/d_i) min(1, d_i pi_j / (d_j pi_i))``, rest on the self-loop), optionally
  ``lazy`` (``(I + P) / 2``).
- :func:`stationary_distribution`, :func:`spectral_gap`, :func:`total_variation`.
- :func:`metropolis_mixing_weights`: gossip weights ``W_ij = 1/(1 + max(d_i, d_j))``;
  :func:`mix` (``x_i <- sum_j W_ij x_j``) and :func:`consensus_distance`.
- :class:`RandomWalk`: a seeded walk with re-routing around failed vertices and a plain
  (JSON-able) ``state_dict``. Dead vertices and the live-graph walk: :mod:`flwr_isoloco.graphs.walk`.
"""

from __future__ import annotations

import bisect
import itertools
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import networkx as nx
import numpy as np

from .specs import (
    GRAPH_KINDS,
    build_graph,
    deferred_graph,
    parse_spec,
    vertex_index,
    vertex_list,
)

__all__ = [
    "GRAPH_KINDS",
    "TRANSITION_KINDS",
    "PeriodicWalkWarning",
    "RandomWalk",
    "build_graph",
    "consensus_distance",
    "deferred_graph",
    "metropolis_mixing_weights",
    "mix",
    "parse_spec",
    "restrict_target",
    "spectral_gap",
    "stationary_distribution",
    "subgraph_transition",
    "total_variation",
    "transition_matrix",
    "vertex_index",
    "vertex_list",
]

TRANSITION_KINDS = ("simple", "metropolis")


class PeriodicWalkWarning(UserWarning):
    """The walk is periodic (bipartite graph, no self-loops): visits never mix; use lazy=True."""


# --------------------------------------------------------------------------- vertices


def _target_vector(G: nx.Graph, target: Any) -> np.ndarray:
    verts = vertex_list(G)
    if target is None:
        return np.full(len(verts), 1.0 / len(verts))
    if isinstance(target, Mapping):
        unknown = [k for k in target if k not in G]
        if unknown:
            raise ValueError(f"target weights: unknown vertex {unknown[0]!r}")
        missing = [v for v in verts if v not in target]
        if missing:
            raise ValueError(f"target weights: no weight for vertex {missing[0]!r}")
        w = np.array([float(target[v]) for v in verts])
    else:
        w = np.asarray(target, dtype=float).reshape(-1)
        if w.shape[0] != len(verts):
            raise ValueError(f"target weights: {w.shape[0]} values for {len(verts)} vertices")
    bad = np.flatnonzero(~np.isfinite(w) | (w <= 0))
    if bad.size:
        raise ValueError(
            f"target weights: vertex {verts[bad[0]]!r} has weight {w[bad[0]]}; "
            "weights must be finite and > 0"
        )
    return w / w.sum()


def transition_matrix(
    G: nx.Graph,
    kind: str = "simple",
    target: Sequence[float] | Mapping[Any, float] | None = None,
    lazy: bool = False,
) -> np.ndarray:
    """Row-stochastic ``P`` (float64, :func:`vertex_list` order).

    ``simple``: ``P_ij = 1/d_i`` for neighbours (stationary ``pi_i ∝ d_i``).
    ``metropolis``: ``P_ij = (1/d_i) min(1, d_i pi_j / (d_j pi_i))`` for neighbours, the rest on
    the self-loop; stationary ``pi`` = ``target`` (uniform when None; else weights, e.g. data
    sizes, as a vertex-ordered sequence or a ``{vertex: weight}`` dict).
    ``lazy``: ``(I + P)/2`` (same ``pi``, aperiodic). Warns :class:`PeriodicWalkWarning` when
    the walk is periodic (bipartite graph and zero diagonal).
    """
    if kind not in TRANSITION_KINDS:
        raise ValueError(f"unknown transition kind {kind!r}: expected one of {TRANSITION_KINDS}")
    if not isinstance(G, nx.Graph) or G.number_of_nodes() == 0:
        raise ValueError("transition_matrix needs a non-empty networkx.Graph")
    if not nx.is_connected(G):
        raise ValueError("transition_matrix: graph is disconnected")
    if kind == "simple" and target is not None:
        raise ValueError("target weights need kind='metropolis' (the simple walk has pi ∝ degree)")
    verts = vertex_list(G)
    idx = {v: i for i, v in enumerate(verts)}
    n = len(verts)
    deg = np.array([G.degree(v) for v in verts], dtype=float)
    P = np.zeros((n, n))
    if kind == "simple":
        for u, v in G.edges:
            i, j = idx[u], idx[v]
            P[i, j] = 1.0 / deg[i]
            P[j, i] = 1.0 / deg[j]
    else:
        pi = _target_vector(G, target)
        for u, v in G.edges:
            i, j = idx[u], idx[v]
            P[i, j] = min(1.0 / deg[i], pi[j] / (deg[j] * pi[i]))
            P[j, i] = min(1.0 / deg[j], pi[i] / (deg[i] * pi[j]))
    if n == 1:
        P[0, 0] = 1.0
    np.fill_diagonal(P, 0.0)
    np.fill_diagonal(P, np.clip(1.0 - P.sum(axis=1), 0.0, None))
    if lazy:
        P = 0.5 * (np.eye(n) + P)
    elif n > 1 and np.all(np.diag(P) <= 1e-15) and nx.is_bipartite(G):
        warnings.warn(
            "the random walk is periodic (bipartite graph, no self-loops): visit frequencies "
            "never converge and the walk alternates sides; make the walk lazy "
            "(RWLoRA(lazy=True); run-config key strategy.lazy=true in the flwr-isoloco apps)",
            PeriodicWalkWarning,
            stacklevel=2,
        )
    return P


def restrict_target(
    G: nx.Graph,
    target: Sequence[float] | Mapping[Any, float] | None,
    vertices: Iterable[Any],
) -> dict[Any, float] | None:
    """``target`` (over every vertex of ``G``) restricted to ``vertices``: ``{v: w_v}``.

    The weights are kept as given; :func:`transition_matrix` on the sub-graph renormalises
    them, so its stationary law is ``pi_S = pi|_S / pi(S)``. ``None`` (uniform) stays None.
    The whole target is checked against ``G`` first (``ValueError`` naming the bad vertex).
    """
    if target is None:
        return None
    _target_vector(G, target)
    keep = set(vertices)
    if isinstance(target, Mapping):
        return {v: target[v] for v in vertex_list(G) if v in keep}
    w = np.asarray(target, dtype=float).reshape(-1)
    return {v: float(w[i]) for i, v in enumerate(vertex_list(G)) if v in keep}


def subgraph_transition(
    G: nx.Graph,
    vertices: Iterable[Any],
    kind: str = "metropolis",
    target: Sequence[float] | Mapping[Any, float] | None = None,
    lazy: bool = False,
) -> np.ndarray:
    """:func:`transition_matrix` of the sub-graph ``S = G[vertices]`` for ``target`` (given over
    all of ``G``) restricted to ``S`` and renormalised (:func:`restrict_target`).

    Rows and columns in ``vertex_list(S)`` order. Metropolis: ``pi(P) = pi|_S / pi(S)``. Raises
    ``ValueError`` if ``S`` is empty or disconnected.
    """
    S = G.subgraph(list(vertices)).copy()
    return transition_matrix(S, kind, target=restrict_target(G, target, S.nodes), lazy=lazy)


def _check_stochastic(P: np.ndarray) -> np.ndarray:
    P = np.asarray(P, dtype=float)
    if P.ndim != 2 or P.shape[0] != P.shape[1] or P.shape[0] == 0:
        raise ValueError(f"transition matrix must be square and non-empty, got shape {P.shape}")
    if not np.all(np.isfinite(P)) or np.any(P < -1e-12):
        raise ValueError("transition matrix has negative or non-finite entries")
    rows = P.sum(axis=1)
    bad = np.flatnonzero(np.abs(rows - 1.0) > 1e-9)
    if bad.size:
        raise ValueError(f"transition matrix row {bad[0]} sums to {rows[bad[0]]}, not 1")
    return P


def stationary_distribution(P: np.ndarray) -> np.ndarray:
    """The ``pi`` with ``pi P = pi``, ``sum pi = 1`` (least squares; unique for connected G)."""
    P = _check_stochastic(P)
    n = P.shape[0]
    A = np.vstack([P.T - np.eye(n), np.ones((1, n))])
    b = np.zeros(n + 1)
    b[-1] = 1.0
    pi, *_ = np.linalg.lstsq(A, b, rcond=None)
    pi = np.clip(pi, 0.0, None)
    return pi / pi.sum()


def spectral_gap(P: np.ndarray) -> float:
    """Absolute spectral gap ``1 - max_{i>=2} |lambda_i(P)|`` (0 for a periodic walk).

    Mixing time scales like ``1/gap``; lazy walks have gap ``(1 - lambda_2)/2`` or more.
    """
    P = _check_stochastic(P)
    if P.shape[0] == 1:
        return 1.0
    mods = np.sort(np.abs(np.linalg.eigvals(P)))[::-1]
    return float(max(0.0, 1.0 - mods[1]))


def metropolis_mixing_weights(G: nx.Graph) -> np.ndarray:
    """Gossip mixing matrix ``W_ij = 1/(1 + max(d_i, d_j))`` on edges, ``W_ii = 1 - sum_j W_ij``.

    Symmetric and doubly stochastic, so repeated mixing converges to the plain average.
    """
    if not isinstance(G, nx.Graph) or G.number_of_nodes() == 0:
        raise ValueError("metropolis_mixing_weights needs a non-empty networkx.Graph")
    verts = vertex_list(G)
    idx = {v: i for i, v in enumerate(verts)}
    W = np.zeros((len(verts), len(verts)))
    for u, v in G.edges:
        if u == v:
            continue
        w = 1.0 / (1.0 + max(G.degree(u), G.degree(v)))
        W[idx[u], idx[v]] = W[idx[v], idx[u]] = w
    np.fill_diagonal(W, 1.0 - W.sum(axis=1))
    return W


def mix(W: np.ndarray, xs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Gossip mixing ``x_i <- sum_j W_ij x_j`` for every tensor name of the ``n`` dicts of
    torch tensors ``xs`` (fp64 accumulation, fp32 result; ``W`` is ``n x n``)."""
    import torch  # only gossip needs torch here

    n = len(xs)
    if W.shape != (n, n):
        raise ValueError(f"mixing matrix {W.shape} for {n} adapters")
    Wt = torch.as_tensor(W, dtype=torch.float64)
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    for k in xs[0]:
        stack = torch.stack([x[k].double().reshape(-1) for x in xs])  # (n, size)
        mixed = (Wt @ stack).float()
        for i in range(n):
            out[i][k] = mixed[i].reshape(xs[0][k].shape).clone()
    return out


def consensus_distance(xs: Sequence[Mapping[str, Any]]) -> float:
    """``sqrt(mean_i ||x_i - xbar||^2)`` over dicts of torch tensors (fp64): how far the
    vertices' copies are from agreeing (0 when they are equal)."""
    import torch

    avg = {k: torch.stack([x[k].double() for x in xs]).mean(0) for k in xs[0]}
    sq = [sum(float((x[k].double() - avg[k]).pow(2).sum()) for k in avg) for x in xs]
    return math.sqrt(sum(sq) / len(sq))


def total_variation(freqs: Sequence[float] | np.ndarray, pi: Sequence[float] | np.ndarray) -> float:
    """``TV = 1/2 sum_i |f_i/sum(f) - pi_i|`` (``freqs`` may be raw visit counts)."""
    f = np.asarray(freqs, dtype=float).reshape(-1)
    p = np.asarray(pi, dtype=float).reshape(-1)
    if f.shape != p.shape:
        raise ValueError(f"total_variation: {f.shape[0]} frequencies vs {p.shape[0]} pi entries")
    if np.any(f < 0) or not np.all(np.isfinite(f)) or f.sum() <= 0:
        raise ValueError("total_variation: frequencies must be finite, >= 0, not all zero")
    return float(0.5 * np.abs(f / f.sum() - p / p.sum()).sum())


# --------------------------------------------------------------------------- walk


class RandomWalk:
    """A seeded random walk on vertices ``vertices`` with transition matrix ``P``.

    ``position`` is the current vertex, ``None`` before the first step; the first step is drawn
    from ``initial`` (default: the stationary distribution of ``P``) unless ``start`` is given.
    ``draw(exclude)`` samples the next vertex from the current row restricted to vertices not in
    ``exclude`` (renormalised; ``None`` when nothing is left) without moving; ``move_to(v)``
    moves (``v`` must have ``P[pos, v] > 0`` or be the current vertex); ``step(exclude)`` =
    draw + move. RNG: numpy PCG64; ``state_dict()`` is plain ints/lists/strs (JSON, no pickle).
    """

    def __init__(
        self,
        P: np.ndarray,
        vertices: Sequence[Any] | None = None,
        *,
        seed: int | None = 0,
        start: Any = None,
        initial: Sequence[float] | None = None,
    ) -> None:
        self.P = _check_stochastic(P)
        n = self.P.shape[0]
        self.vertices = list(range(n)) if vertices is None else list(vertices)
        if len(self.vertices) != n or len(set(self.vertices)) != n:
            raise ValueError(f"RandomWalk: {len(self.vertices)} distinct vertices for a {n}x{n} P")
        self._index = {v: i for i, v in enumerate(self.vertices)}
        if initial is None:
            self.initial = stationary_distribution(self.P)
        else:
            self.initial = np.asarray(initial, dtype=float).reshape(-1)
            if self.initial.shape[0] != n or np.any(self.initial < 0) or self.initial.sum() <= 0:
                raise ValueError(
                    "RandomWalk: initial distribution must be n values >= 0, not all 0"
                )
            self.initial = self.initial / self.initial.sum()
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.position: Any = None
        if start is not None:
            self._check_vertex(start)
            self.position = start

    def _check_vertex(self, v: Any) -> int:
        try:
            return self._index[v]
        except (KeyError, TypeError):
            raise ValueError(f"unknown vertex {v!r} (graph vertices: {self.vertices})") from None

    def probabilities(self, exclude: Iterable[Any] = ()) -> np.ndarray:
        """Next-vertex distribution from the current position, ``exclude`` removed (unnormalised)."""
        row = self.initial if self.position is None else self.P[self._check_vertex(self.position)]
        p = row.copy()
        for v in exclude:
            p[self._check_vertex(v)] = 0.0
        return p

    def draw(self, exclude: Iterable[Any] = ()) -> Any:
        """Sample the next vertex (not moving); ``None`` if every candidate is excluded."""
        excluded = list(exclude)
        if excluded:
            p = self.probabilities(excluded).tolist()
        else:  # fast path: the row as a plain list
            row = self.initial if self.position is None else self.P[self._index[self.position]]
            p = row.tolist()
        cum = list(itertools.accumulate(p))
        total = cum[-1]
        if total <= 0:
            return None
        # inverse CDF with one uniform: one RNG draw per call, whatever the exclusions
        u = self.rng.random() * total
        i = min(bisect.bisect_right(cum, u), len(p) - 1)
        while p[i] <= 0:  # guard against landing on a zero-width bin at the float edge
            i -= 1
        return self.vertices[i]

    def set_transition(self, P: np.ndarray) -> None:
        """Swap the transition matrix (same vertices; position and RNG unchanged), e.g. for the
        live graph while some vertices are dead (:mod:`flwr_isoloco.graphs.walk`)."""
        P = _check_stochastic(P)
        if P.shape != self.P.shape:
            raise ValueError(f"RandomWalk.set_transition: shape {P.shape}, expected {self.P.shape}")
        self.P = P

    def move_to(self, v: Any) -> None:
        """Move to ``v``: an edge of ``P`` (``P[pos, v] > 0``), or stay where the walk is."""
        j = self._check_vertex(v)
        if self.position is not None and v != self.position:
            i = self._check_vertex(self.position)
            if self.P[i, j] <= 0:
                raise ValueError(f"cannot move from vertex {self.position!r} to {v!r}: not an edge")
        self.position = v

    def step(self, exclude: Iterable[Any] = ()) -> Any:
        v = self.draw(exclude)
        if v is not None:
            self.move_to(v)
        return v

    def __iter__(self) -> RandomWalk:
        return self

    def __next__(self) -> Any:
        return self.step()

    def state_dict(self) -> dict[str, Any]:
        s = self.rng.bit_generator.state
        return {
            "position": self.position,
            "rng": {
                "bit_generator": s["bit_generator"],
                "state": int(s["state"]["state"]),
                "inc": int(s["state"]["inc"]),
                "has_uint32": int(s["has_uint32"]),
                "uinteger": int(s["uinteger"]),
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            pos = state["position"]
            r = state["rng"]
            rng_state = {
                "bit_generator": str(r["bit_generator"]),
                "state": {"state": int(r["state"]), "inc": int(r["inc"])},
                "has_uint32": int(r["has_uint32"]),
                "uinteger": int(r["uinteger"]),
            }
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"RandomWalk.load_state_dict: bad state ({e!r})") from None
        if rng_state["bit_generator"] != "PCG64":
            raise ValueError(f"RandomWalk state uses {rng_state['bit_generator']}, expected PCG64")
        if pos is not None:
            self._check_vertex(pos)
        self.rng.bit_generator.state = rng_state
        self.position = pos
