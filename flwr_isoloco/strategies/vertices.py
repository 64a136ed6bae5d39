"""Which Flower node holds which graph vertex: the QUERY round of the graph strategies.

Node ids are random and new every run, so at start (and for node ids never seen before) the
server asks every node for ``context.node_config[vertex_key]`` (default ``partition-id``) and
maps graph vertices to node ids. Answers are untrusted: unknown values, error replies and
silence leave the node unmapped (logged), never raise.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from .common import SentLedger

__all__ = ["QUERY_VERTEX_KEY", "VertexMap", "discover_vertices", "wait_for_nodes"]

QUERY_VERTEX_KEY = "vertex-key"


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


def wait_for_nodes(grid: Grid, want: int, wait_s: float, what: str) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        have = len(list(grid.get_node_ids()))
        if have >= want or time.monotonic() >= deadline:
            if have < want:
                log(
                    WARNING,
                    "%s: only %d of %d nodes connected after %.0fs",
                    what,
                    have,
                    want,
                    wait_s,
                )
            return
        log(INFO, "%s: waiting for nodes: %d of %d connected", what, have, want)
        time.sleep(1.0)
