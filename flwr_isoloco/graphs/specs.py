"""Client graphs from a spec (pure networkx, no Flower): parsing, building, vertex order.

Vertices are client names: ints (a client's ``partition-id``) or strings (a site name);
:func:`vertex_list` orders them (ints ascending, then strings), and every matrix of
:mod:`flwr_isoloco.graphs` is indexed in that order. :func:`build_graph` returns a connected
``networkx.Graph`` from ``complete``, ``ring``, ``star``, ``erdos_renyi:p=0.3``,
``random_regular:d=3``, an inline edge list ``"0-1,1-2,2-0"``, an edge-list file or a graph;
:func:`deferred_graph` tells a strategy to build a named family on the connected nodes.
Import these from :mod:`flwr_isoloco.graphs`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np

__all__ = [
    "GRAPH_KINDS",
    "build_graph",
    "deferred_graph",
    "parse_spec",
    "vertex_index",
    "vertex_list",
]

GRAPH_KINDS = ("complete", "ring", "star", "erdos_renyi", "random_regular")
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


def deferred_graph(spec: Any, n: int | None) -> bool:
    """Whether ``spec`` is a named family (``complete``, ``ring``...) given without ``n``: a
    strategy then builds it on the connected nodes. The spec's syntax is checked now."""
    if n is not None or not isinstance(spec, str) or _looks_like_edge_list(spec):
        return False
    if os.sep in spec or "." in spec.split(":")[0] or Path(spec).is_file():
        return False
    parse_spec(spec)  # unknown family / bad parameter -> ValueError now, not at setup
    return True


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
