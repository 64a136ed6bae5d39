"""Waiting for SuperNodes: the one helper every strategy and app uses.

Simulated and deployed SuperNodes register after the ServerApp starts, so a server that looks
at ``grid.get_node_ids()`` at once sees too few. :func:`wait_for_nodes` polls until at least
``min_nodes`` are connected and their number has not changed for ``settle_s`` seconds, and
then returns the connected node ids (sorted). When ``timeout_s`` passes first it returns what
is there if that is ``>= max(min_nodes, 1)`` (a late node can still join a later round) and
otherwise raises :class:`NodeWaitError` (``strict=True``) or logs a warning and returns
(``strict=False``: callers that can run on fewer nodes, such as the graph strategies, which
drop the vertices that have no node). ``timeout_s=None`` waits for ever, as Flower's own
``sample_nodes`` does.
"""

from __future__ import annotations

import time
from logging import INFO, WARNING

from flwr.common.logger import log
from flwr.serverapp import Grid

__all__ = ["NodeWaitError", "wait_for_nodes"]

POLL_S = 0.25
"""Seconds between two looks at the grid."""
LOG_EVERY_S = 5.0
"""Seconds between two "waiting for nodes" log lines."""


class NodeWaitError(RuntimeError):
    """Fewer nodes than required connected before the timeout."""


def wait_for_nodes(
    grid: Grid,
    min_nodes: int = 1,
    *,
    settle_s: float = 0.0,
    timeout_s: float | None = None,
    strict: bool = True,
    what: str = "server",
) -> list[int]:
    """Wait until ``>= min_nodes`` nodes are connected and their count is stable for
    ``settle_s``; return the connected node ids, sorted.

    Parameters
    ----------
    grid : Grid
        The run's grid.
    min_nodes : int
        Nodes required (``0`` behaves as ``1`` for the timeout rule: a run needs a node).
    settle_s : float
        The count must be unchanged this long (0: return as soon as there are enough).
    timeout_s : float or None
        Give up after this long (None: wait for ever).
    strict : bool
        On timeout with fewer than ``max(min_nodes, 1)`` nodes: raise :class:`NodeWaitError`
        (True) or log a warning and return what is there (False).
    what : str
        Label for log lines and the error.
    """
    t0 = time.monotonic()
    last, since, logged = -1, t0, t0 - LOG_EVERY_S
    while True:
        nodes = sorted(grid.get_node_ids())
        now = time.monotonic()
        if len(nodes) != last:
            last, since = len(nodes), now
        if len(nodes) >= min_nodes and now - since >= settle_s:
            return nodes
        if timeout_s is not None and now - t0 >= timeout_s:
            if len(nodes) >= max(min_nodes, 1):
                return nodes
            msg = (
                f"{what}: only {len(nodes)} of {min_nodes} nodes connected after {timeout_s:.0f} s"
            )
            if strict:
                raise NodeWaitError(msg)
            log(WARNING, "%s", msg)
            return nodes
        if now - logged >= LOG_EVERY_S and len(nodes) < min_nodes:
            log(INFO, "%s: waiting for nodes: %d of %d connected", what, len(nodes), min_nodes)
            logged = now
        time.sleep(POLL_S)
