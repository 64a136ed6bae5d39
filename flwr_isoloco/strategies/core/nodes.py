"""Waiting for SuperNodes: the one helper every strategy and app uses.

Simulated and deployed SuperNodes register after the ServerApp starts, so a server that looks
at ``grid.get_node_ids()`` at once sees too few. :func:`wait_for_nodes` polls until at least
``min_nodes`` are connected and their number has not changed for ``settle_s`` seconds, and
then returns the connected node ids (sorted). When ``timeout_s`` passes first it returns what
is there if that is ``>= max(min_nodes, 1)`` (a late node can still join a later round) and
otherwise raises :class:`NodeWaitError` (``strict=True``) or logs a warning and returns
(``strict=False``: callers that can run on fewer nodes, such as the graph strategies, which
drop the vertices that have no node). ``timeout_s=None`` waits for ever, as Flower's own
``sample_nodes`` does. Time is ``time.monotonic`` / ``time.sleep``, or the grid's
``time_source`` when it has one (the fake grid's virtual clock), as in the round driver.

:func:`nodes_for_round` is the bounded wait of a round (DiLoCo / IsoLoCo, before sampling):
wait up to ``timeout_s`` for ``need`` nodes; then go on with the ``n`` connected ones when
``n >= quorum_count(quorum, need)`` (a quorum is set), else raise :class:`NodeWaitError`
naming what was missing, which ends the run ``failed`` with that reason (the app runner
records it in ``results.json``). A site that died with ``min-nodes`` equal to the number of
sites thus stops the run after one timeout instead of leaving it waiting for ever.
"""

from __future__ import annotations

import time
from logging import INFO, WARNING

from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_isoloco.strategies.core.stream import quorum_count

__all__ = ["DEFAULT_NODE_WAIT_S", "NodeWaitError", "nodes_for_round", "wait_for_nodes"]

POLL_S = 0.25
"""Seconds between two looks at the grid."""
LOG_EVERY_S = 5.0
"""Seconds between two "waiting for nodes" log lines."""
DEFAULT_NODE_WAIT_S = 3600.0
"""A round's node wait when no round timeout is known (Flower's default round timeout)."""


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
    clock = getattr(grid, "time_source", None) or time
    t0 = clock.monotonic()
    last, since, logged = -1, t0, t0 - LOG_EVERY_S
    while True:
        nodes = sorted(grid.get_node_ids())
        now = clock.monotonic()
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
        clock.sleep(POLL_S)


def nodes_for_round(
    grid: Grid,
    need: int,
    *,
    timeout_s: float | None,
    quorum: float | int | None = None,
    what: str = "server",
) -> list[int]:
    """The connected nodes (sorted) to sample a round from, waiting at most ``timeout_s``.

    ``need`` nodes connected: returned at once (as Flower's ``sample_nodes``). Still fewer
    after ``timeout_s``: with a ``quorum`` (a fraction in (0, 1] of ``need``, rounded up, or a
    count) the ``n`` connected ones when ``n >= max(quorum_count(quorum, need), 1)``, logged;
    otherwise :class:`NodeWaitError` saying how many of how many came and what to change.
    ``timeout_s=None`` waits for ever (no bound: only for callers that have none)."""
    nodes = wait_for_nodes(grid, need, timeout_s=timeout_s, strict=False, what=what)
    if len(nodes) >= need:
        return nodes
    floor = need if quorum is None else max(quorum_count(quorum, need), 1)
    if len(nodes) >= floor:
        log(
            WARNING,
            "%s: going on with the %d connected nodes of %d wanted (quorum %s = %d)",
            what,
            len(nodes),
            need,
            quorum,
            floor,
        )
        return nodes
    rule = "no quorum is set" if quorum is None else f"the quorum {quorum!r} needs {floor}"
    raise NodeWaitError(
        f"{what}: only {len(nodes)} of the {need} nodes the round needs connected after "
        f"{timeout_s:g} s ({rule}); a site is down or unreachable: restart it, or lower "
        "min-nodes / set a quorum so the run can go on without it"
    )
