"""Which Flower node holds which graph vertex: the QUERY round of the graph strategies.

Node ids are random and new every run, so at start (and for node ids never seen before) the
server asks every node for ``context.node_config[vertex_key]`` (default ``partition-id``) and
maps graph vertices to node ids. Answers are untrusted: unknown values, error replies and
silence leave the node unmapped (logged), never raise.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_isoloco.strategies.core.ledger import SentLedger

__all__ = ["QUERY_VERTEX_KEY", "VertexMap", "discover_vertices", "map_vertices"]

QUERY_VERTEX_KEY = "vertex-key"
NO_QUERY_HANDLER = "No query function registered"
"""What Flower's ClientApp raises for a QUERY message when it has no ``@app.query()``."""


def _vertex_from_value(value: Any, vertices: Iterable[Any]) -> Any:
    verts = set(vertices)
    if value in verts and not isinstance(value, bool):
        return value
    if isinstance(value, (str, float)):
        try:
            as_int = int(value)
            if as_int in verts and float(value) == as_int:
                return as_int
        except (ValueError, OverflowError):  # nan, inf
            pass
    if str(value) in verts:
        return str(value)
    return None


class VertexMap:
    """Which Flower node holds which graph vertex (learned by a QUERY round)."""

    def __init__(self) -> None:
        self.node_of: dict[Any, int] = {}
        self.unmapped_nodes: set[int] = set()  # answered with no/unknown vertex, or failed
        self.no_handler: set[int] = set()  # their ClientApp has no @app.query() function
        self.by_node_order = False  # vertices were assigned in node-id order (no answers)
        self.bad_answers = 0  # replies whose value is not a graph vertex

    def known_nodes(self) -> set[int]:
        return set(self.node_of.values()) | self.unmapped_nodes


def discover_vertices(
    grid: Grid,
    vertices: list[Any],
    *,
    vertex_key: str = "partition-id",
    timeout: float | None = 60.0,
    node_ids: Iterable[int] | None = None,
    vmap: VertexMap | None = None,
    what: str = "rwlora",
) -> VertexMap:
    """QUERY ``node_ids`` (default: all) for ``context.node_config[vertex_key]``; map vertices.

    A duplicate vertex keeps the smallest node id; unknown values and error replies are logged
    and the node is left unmapped. Never raises on a bad reply.
    """
    vmap = vmap or VertexMap()
    nodes = sorted(set(grid.get_node_ids()) if node_ids is None else set(node_ids))
    if not nodes:
        return vmap
    content = RecordDict({"config": ConfigRecord({QUERY_VERTEX_KEY: vertex_key})})
    ledger = SentLedger()
    msgs = ledger.remember(
        [Message(content=content, message_type=MessageType.QUERY, dst_node_id=n) for n in nodes]
    )
    replies = list(grid.send_and_receive(msgs, timeout=timeout))
    answered: set[int] = set()
    for reply in replies:
        node = ledger.sender(reply)
        answered.add(node)
        if reply.has_error():
            if NO_QUERY_HANDLER in str(reply.error.reason):
                vmap.no_handler.add(node)  # explained once by the caller, not per node
            else:
                log(WARNING, "%s: query to node %d failed: %s", what, node, reply.error.reason)
            vmap.unmapped_nodes.add(node)
            continue
        value = None
        for rec in list(reply.content.config_records.values()) + list(
            reply.content.metric_records.values()
        ):
            if vertex_key in rec:
                value = rec[vertex_key]
                break
        v = _vertex_from_value(value, vertices) if value is not None else None
        if v is None:
            log(
                WARNING,
                "%s: node %d answered %s=%r, which is not a graph vertex; node ignored",
                what,
                node,
                vertex_key,
                value,
            )
            vmap.unmapped_nodes.add(node)
            vmap.bad_answers += 1
            continue
        old = vmap.node_of.get(v)
        if old is not None and old != node and old in grid.get_node_ids():
            keep = min(old, node)
            log(
                WARNING,
                "%s: vertex %r claimed by nodes %d and %d; using node %d",
                what,
                v,
                old,
                node,
                keep,
            )
            vmap.unmapped_nodes.add(max(old, node))
            vmap.node_of[v] = keep
        else:
            vmap.node_of[v] = node
    for node in set(nodes) - answered:
        log(WARNING, "%s: no answer to the vertex query from node %d (timeout)", what, node)
    return vmap


def map_vertices(
    grid: Grid,
    vertices: list[Any],
    *,
    vertex_key: str,
    timeout: float | None,
    attempts: int,
    what: str,
) -> VertexMap:
    """Map graph vertices to node ids: QUERY every node, then re-ask the silent ones up to
    ``attempts`` times in all. When no node answers with a vertex (e.g. a plain ClientApp with
    only ``@app.train``/``@app.evaluate``), vertex ``i`` (in :func:`vertex_list` order) is
    the ``i``-th connected node in node-id order, logged once (``vmap.by_node_order``). Nodes
    that answered a value that is no vertex are never remapped that way (the run is refused).

    One node (the smallest id) is asked first: every node of a run runs the same ClientApp,
    so if it has no ``@app.query()`` handler none has, and the others are not asked (Flower
    logs a traceback for each failed QUERY; the probe costs one of them instead of one per
    node, for one extra round trip at start)."""
    listed = sorted(grid.get_node_ids())
    q = {"vertex_key": vertex_key, "timeout": timeout, "what": what}
    vmap = discover_vertices(grid, vertices, node_ids=listed[:1], **q)
    if not vmap.no_handler and len(listed) > 1:
        discover_vertices(grid, vertices, node_ids=listed[1:], vmap=vmap, **q)
    for attempt in range(2, attempts + 1):
        silent = set(grid.get_node_ids()) - vmap.known_nodes()
        if not silent or len(vmap.node_of) == len(vertices) or vmap.no_handler:
            break
        log(INFO, "%s: vertex query attempt %d for %d silent node(s)", what, attempt, len(silent))
        discover_vertices(grid, vertices, node_ids=silent, vmap=vmap, **q)
    if vmap.node_of or vmap.bad_answers:  # answers that name no vertex: the caller refuses
        if vmap.no_handler:
            log(
                WARNING,
                "%s: node(s) %s have no @app.query() handler; left out",
                what,
                sorted(vmap.no_handler),
            )
        return vmap
    nodes = sorted(grid.get_node_ids())
    why = (
        f'the ClientApp has no @app.query() handler (the one "No query function registered" '
        f"error above is the probe of node {min(vmap.no_handler)}; the others were not asked)"
        if vmap.no_handler
        else f"no node answered the vertex query with a {vertex_key!r}"
    )
    log(
        WARNING,
        "%s: %s, so vertices are the connected nodes in node-id order; register "
        "flwr_isoloco.clients.partition_id_query as @app.query() to map vertices to partitions",
        what,
        why,
    )
    fallback = VertexMap()
    fallback.by_node_order = True
    fallback.no_handler = set(vmap.no_handler)
    fallback.node_of = dict(zip(vertices, nodes, strict=False))
    fallback.unmapped_nodes = set(nodes[len(vertices) :])
    return fallback


def assign_new_nodes(vmap: VertexMap, vertices: list[Any], listed: set[int]) -> list[Any]:
    """Node-id-order mapping (``by_node_order``): give each vertex whose node is gone the next
    new node id (restarted SuperNodes get new ids); returns the vertices reassigned."""
    new = sorted(listed - vmap.known_nodes())
    moved = []
    for v in vertices:
        if not new:
            break
        if vmap.node_of.get(v) not in listed:
            vmap.node_of[v] = new.pop(0)
            moved.append(v)
    return moved
