"""Client graphs and random walks over them (pure networkx / numpy, no Flower).

Vertices are client names: ints (a client's ``partition-id``) or strings (a site name). Every
matrix and vector here is indexed by :func:`vertex_list` (ints ascending, then strings).

- :func:`build_graph`: a connected ``networkx.Graph`` from a spec (``complete``, ``ring``,
  ``star``, ``erdos_renyi:p=0.3``, ``random_regular:d=3``, ``"0-1,1-2,2-0"``, an edge-list
  file, or a graph).
- :func:`transition_matrix`: ``simple`` (``P_ij = 1/d_i``) or ``metropolis`` towards a target
  ``pi`` (``P_ij = (1/d_i) min(1, d_i pi_j / (d_j pi_i))``, rest on the self-loop), optionally
  ``lazy`` (``(I + P) / 2``).
- :func:`stationary_distribution`, :func:`spectral_gap`, :func:`total_variation`.
- :func:`metropolis_mixing_weights`: gossip weights ``W_ij = 1/(1 + max(d_i, d_j))``.
- :class:`RandomWalk`: a seeded walk with re-routing around failed vertices and a plain
  (JSON-able) ``state_dict``. Dead vertices and the live-graph walk: :mod:`flwr_isoloco.walk`.
"""

from __future__ import annotations

import bisect
import itertools
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np

__all__ = [
    "GRAPH_KINDS",
    "TRANSITION_KINDS",
    "PeriodicWalkWarning",
    "RandomWalk",
    "build_graph",
    "metropolis_mixing_weights",
    "parse_spec",
    "spectral_gap",
    "stationary_distribution",
    "total_variation",
    "transition_matrix",
    "vertex_index",
    "vertex_list",
]

GRAPH_KINDS = ("complete", "ring", "star", "erdos_renyi", "random_regular")
TRANSITION_KINDS = ("simple", "metropolis")
_GRAPH_PARAMS = {
    "complete": {},
    "ring": {},
    "star": {},
    "erdos_renyi": {"p": float},
    "random_regular": {"d": int},
}
# Erdos-Renyi draws are conditioned on connectivity by redrawing (same seeded generator).
_MAX_CONNECT_TRIES = 1000
_EDGE_RE = re.compile(r"^\s*([^\s,\-]+)\s*-\s*([^\s,\-]+)\s*$")


class PeriodicWalkWarning(UserWarning):
    """The walk is periodic (bipartite graph, no self-loops): visits never mix; use lazy=True."""


# --------------------------------------------------------------------------- vertices


def _vertex_key(v: Any) -> tuple[int, Any]:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer, str)):
        raise ValueError(f"graph vertex {v!r} must be an int or a str, got {type(v).__name__}")
    return (0, int(v)) if not isinstance(v, str) else (1, v)


def vertex_list(G: nx.Graph) -> list:
    """The vertex order of every matrix and vector in this module: ints ascending, then strs."""
    return sorted(G.nodes, key=_vertex_key)


def vertex_index(G: nx.Graph) -> dict:
    """``vertex -> row`` in :func:`vertex_list` order."""
    return {v: i for i, v in enumerate(vertex_list(G))}


def _parse_vertex(token: str) -> int | str:
    token = token.strip()
    try:
        return int(token)
    except ValueError:
        return token


# --------------------------------------------------------------------------- graphs


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"erdos_renyi:p=0.3"`` -> ``("erdos_renyi", {"p": 0.3})``; unknown names/keys raise."""
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower().replace("-", "_")
    if name not in _GRAPH_PARAMS:
        raise ValueError(
            f"unknown graph spec {spec!r}: expected one of {', '.join(GRAPH_KINDS)} "
            "(e.g. 'erdos_renyi:p=0.3'), an edge list like '0-1,1-2,2-0', or an edge-list file"
        )
    allowed = _GRAPH_PARAMS[name]
    params: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in allowed:
            raise ValueError(
                f"graph spec {spec!r}: bad parameter {item!r}; {name} takes "
                f"{', '.join(f'{k}=<{t.__name__}>' for k, t in allowed.items()) or 'no parameters'}"
            )
        try:
            params[key] = allowed[key](value.strip())
        except ValueError:
            raise ValueError(
                f"graph spec {spec!r}: parameter {key}={value.strip()!r} is not a "
                f"{allowed[key].__name__}"
            ) from None
    missing = set(allowed) - set(params)
    if missing:
        raise ValueError(f"graph spec {spec!r}: missing parameter(s) {sorted(missing)}")
    return name, params


def _need_n(spec: str, n: int | None, minimum: int) -> int:
    if n is None:
        raise ValueError(f"graph spec {spec!r} needs the number of vertices n")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < minimum:
        raise ValueError(f"graph spec {spec!r} needs n >= {minimum} vertices, got n={n!r}")
    return int(n)


def _named_graph(spec: str, n: int | None, seed: int | None) -> nx.Graph:
    name, params = parse_spec(spec)
    if name == "complete":
        return nx.complete_graph(_need_n(spec, n, 1))
    if name == "ring":
        return nx.cycle_graph(_need_n(spec, n, 3))
    if name == "star":
        return nx.star_graph(_need_n(spec, n, 2) - 1)  # centre 0, leaves 1..n-1
    if name == "random_regular":
        n = _need_n(spec, n, 2)
        d = params["d"]
        if not 1 <= d < n or (n * d) % 2:
            raise ValueError(f"graph spec {spec!r}: need 1 <= d < n and n*d even (n={n}, d={d})")
        return _first_connected(
            lambda s: nx.random_regular_graph(d, n, seed=s),
            seed,
            f"graph spec {spec!r}: no connected draw in {_MAX_CONNECT_TRIES} tries",
        )
    # erdos_renyi
    n = _need_n(spec, n, 1)
    p = params["p"]
    if not 0.0 < p <= 1.0:
        raise ValueError(f"graph spec {spec!r}: need 0 < p <= 1, got p={p}")
    return _first_connected(
        lambda s: nx.gnp_random_graph(n, p, seed=s),
        seed,
        f"graph spec {spec!r}: G({n}, {p}) was disconnected in {_MAX_CONNECT_TRIES} seeded draws; "
        "raise p",
    )


def _first_connected(draw: Callable[[int], nx.Graph], seed: int | None, error: str) -> nx.Graph:
    """First connected graph among ``draw(s)`` for seeds ``s`` from one seeded generator."""
    rng = np.random.default_rng(seed)
    for _ in range(_MAX_CONNECT_TRIES):
        G = draw(int(rng.integers(2**31)))
        if nx.is_connected(G):
            return G
    raise ValueError(error)


def _edges_graph(edges: Iterable[tuple[Any, Any]], where: str) -> nx.Graph:
    G = nx.Graph()
    for u, v in edges:
        if u == v:
            raise ValueError(f"{where}: self-loop {u}-{v} (laziness is set by lazy=True instead)")
        G.add_edge(u, v)
    return G


def _parse_edge_list(text: str, where: str) -> nx.Graph:
    edges = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        for item in line.split(",") if "-" in line else [line]:
            item = item.strip()
            if not item:
                continue
            m = _EDGE_RE.match(item)
            parts = [m.group(1), m.group(2)] if m else item.split()
            if len(parts) != 2:
                raise ValueError(f"{where} line {lineno}: bad edge {item!r} (want 'u-v' or 'u v')")
            edges.append((_parse_vertex(parts[0]), _parse_vertex(parts[1])))
    if not edges:
        raise ValueError(f"{where}: no edges")
    return _edges_graph(edges, where)


def _looks_like_edge_list(spec: str) -> bool:
    items = [s for s in spec.split(",") if s.strip()]
    return bool(items) and all(_EDGE_RE.match(s) for s in items)


def build_graph(
    spec: str | os.PathLike | nx.Graph, n: int | None = None, seed: int | None = None
) -> nx.Graph:
    """Build the client graph and check it.

    ``spec``: a named family (``complete``, ``ring``, ``star`` with centre 0,
    ``erdos_renyi:p=P`` and ``random_regular:d=D``, both seeded and conditioned on being
    connected by redrawing), an inline edge list ``"0-1,1-2,2-0"``, a path to a file with one
    edge per line (``u v`` or ``u-v``, or comma-separated ``u-v`` items; ``#`` comments), or a
    ``networkx.Graph``. Named families have vertices ``0..n-1``. When ``n`` is given for an edge
    list / file / graph, the vertices must be exactly ``0..n-1``.
    Raises ``ValueError`` naming the problem (disconnected, unknown vertex, n mismatch, ...).
    """
    where = f"graph spec {spec!r}"
    if isinstance(spec, nx.Graph):
        if spec.is_directed() or spec.is_multigraph():
            raise ValueError("graph must be an undirected simple networkx.Graph")
        for v in spec.nodes:
            _vertex_key(v)
        loops = list(nx.selfloop_edges(spec))
        if loops:
            raise ValueError(f"graph has self-loop(s) {loops[:3]} (use lazy=True for laziness)")
        G = nx.Graph(spec)
        where = "networkx graph"
    elif isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        is_file = Path(text).is_file()
        if (
            isinstance(spec, os.PathLike)
            or is_file
            or (not _looks_like_edge_list(text) and (os.sep in text or "." in text.split(":")[0]))
        ):
            path = Path(text)
            if not is_file:
                raise ValueError(f"graph edge-list file {text!r} does not exist")
            G = _parse_edge_list(path.read_text(), f"graph file {text!r}")
            where = f"graph file {text!r}"
        elif _looks_like_edge_list(text):
            G = _parse_edge_list(text, where)
        else:
            G = _named_graph(text, n, seed)
            n = None  # already has n vertices
    else:
        raise ValueError(f"graph spec must be a str, a path or a networkx.Graph, got {spec!r}")

    if n is not None:
        want = set(range(int(n)))
        have = set(G.nodes)
        unknown = sorted(have - want, key=_vertex_key)
        if unknown:
            raise ValueError(f"{where}: unknown vertex {unknown[0]!r} (n={n}: vertices 0..{n - 1})")
        missing = sorted(want - have)
        if missing:
            raise ValueError(
                f"{where}: n={n} but vertex {missing[0]} has no edge (graph would be disconnected)"
            )
    if G.number_of_nodes() == 0:
        raise ValueError(f"{where}: graph has no vertices")
    if not nx.is_connected(G):
        comps = sorted((sorted(c, key=_vertex_key) for c in nx.connected_components(G)), key=len)
        raise ValueError(
            f"{where}: graph is disconnected ({len(comps)} components; smallest: {comps[0][:10]})"
        )
    return G


# --------------------------------------------------------------------------- matrices


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
            "never converge and the walk alternates sides; use lazy=True",
            PeriodicWalkWarning,
            stacklevel=2,
        )
    return P


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
        live graph while some vertices are dead (:mod:`flwr_isoloco.walk`)."""
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
