"""RW-LoRA: one LoRA adapter (the *token*) random-walks over a graph of clients.

The algorithm is section 4 of the repository's ``docs/algorithms.md`` ("Algorithms"). Each round the token (adapter arrays,
plus the optimiser state when ``carry_optimizer_state=True``) goes to exactly one node, the vertex ``v_t`` of the walk; that
node takes K local steps and its reply becomes the new token; the walk then draws ``v_{t+1}``
from ``P[v_t, :]``. Nothing is averaged, so there is no LoRA product-aggregation error.

Message conventions (QUERY, TRAIN instruction and reply, the optimiser-state records) are
specified in the repository's ``docs/rwlora.md`` ("RW-LoRA and gossip LoRA"), "Message conventions".

The token is never lost: an error reply, a timeout or a bad update (validated by
:class:`~flwr_isoloco.strategies.core.replies.ReplyValidator`: keys, shapes, dtype, NaN/inf, update
norm; and :func:`~flwr_isoloco.strategies.core.wire.check_train_metrics`: ``local-steps``,
``data-cursor``, ``partition-id``) leaves the last good token in place, the failure is counted,
and the walk re-routes: it redraws among the *other* neighbours (the current row without the
self-loop and without the vertices that failed this round, renormalised; the token stays and
trains again only when no other candidate is left), up to ``max_reroutes`` times per round.
A vertex that fails ``dead_after`` consecutive times is dead for a back-off that doubles on
repeated deaths; meanwhile the walk moves on the live graph (same target, relays across dead
vertices where the live graph is disconnected): :mod:`flwr_isoloco.graphs.walk`, the repository's ``docs/rwlora.md`` ("RW-LoRA and gossip LoRA").

Bytes: ``bytes-relayed`` counts what crossed the wire through the server (instruction down +
reply up, also for failed attempts), ``bytes-p2p`` what a peer-to-peer deployment would send
(one token per hop to a *different* vertex, including failed attempts and relays; a lazy
self-loop stays on the node and costs 0; the first placement costs one token).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import networkx as nx
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_isoloco.graphs import (
    LiveMatrix,
    LiveTransitions,
    RandomWalk,
    VertexHealth,
    reroute_exclusions,
    restrict_target,
    spectral_gap,
    subgraph_transition,
    total_variation,
    vertex_list,
)
from flwr_isoloco.strategies.core.ledger import SentLedger
from flwr_isoloco.strategies.core.wire import (
    _record_of,
    record_nbytes,
    record_tensors,
)
from flwr_isoloco.strategies.graph.base import GraphStrategy, graph_summary
from flwr_isoloco.strategies.graph.rwlora_hops import RWLoRAHops
from flwr_isoloco.strategies.graph.rwlora_state import RWLoRAState
from flwr_isoloco.strategies.graph.rwlora_variants import RWLoRAVariants
from flwr_isoloco.strategies.graph.settings import GRAPH_REFUSED, ReplyChecks, Rounds
from flwr_isoloco.strategies.graph.vertices import QUERY_VERTEX_KEY, VertexMap, discover_vertices

__all__ = ["GraphStrategy", "RWLoRA", "VertexMap", "discover_vertices", "record_nbytes"]
_REEXPORTED = (QUERY_VERTEX_KEY, _record_of)  # older imports from this module
ONE_NODE_PER_HOP = "each hop goes to one node and waits for its reply (timeout), then re-routes"


# ----------------------------------------------------------------------------- RW-LoRA


class RWLoRA(RWLoRAVariants, RWLoRAHops, RWLoRAState, GraphStrategy):
    """Random-walk LoRA: the token visits one vertex per round (Message API strategy).

    Parameters
    ----------
    graph : str | networkx.Graph
        Spec for :func:`flwr_isoloco.graphs.build_graph` (``complete``, ``ring``,
        ``erdos_renyi:p=0.3``, ``"0-1,1-2"``, a file) or a graph. Vertices are the clients'
        ``node_config[vertex_key]`` values.
    num_vertices : int, optional
        ``n`` for named specs (in simulation: the number of SuperNodes).
    transition : ``"metropolis"`` (default) | ``"simple"``
        Transition matrix (:func:`flwr_isoloco.graphs.transition_matrix`): Metropolis-Hastings
        toward ``target`` (the paper's walk), or the simple walk (visits ∝ degree).
    target : sequence or dict, optional
        Metropolis target weights per vertex (e.g. data sizes); uniform if None.
    lazy : bool
        Lazy walk ``(I + P)/2``; needed on bipartite graphs (even rings, stars).
    seed : int
        Seeds the walk (first vertex from the stationary law, then each hop).
    start_vertex : optional
        Fix the first vertex instead of drawing it.
    local_steps : int
        K, sent as ``local-steps`` in the ConfigRecord.
    carry_optimizer_state : bool
        Ship the optimiser state with the token (record keys: "Message conventions" in
        the repository's ``docs/rwlora.md`` ("RW-LoRA and gossip LoRA")).
    max_reroutes : int, optional
        Re-routes per round after a failed hop (default: the maximum degree, i.e. try every
        neighbour); when exhausted the round ends with the token kept where it was.
    checks : ReplyChecks
        ``max_update_norm`` / ``max_norm_ratio``: reject an update ``||token - reply||`` above
        this bound / times the median of the last ``norm_window`` accepted ones (needs 3).
    dead_after : int
        Consecutive failed hops after which a vertex is dead (default 2; 0 = never dead).
    dead_backoff, dead_backoff_max : int
        Rounds a dead vertex is skipped (default 8), doubling on each new death up to
        ``dead_backoff_max`` (default 128) (:class:`flwr_isoloco.graphs.VertexHealth`).
    rounds : Rounds
        ``max_empty_rounds``: rounds in a row without an accepted hop that stop the run
        (default 3; 0 = off). Fields a walk does not use are refused (``REFUSED_SETTINGS``).
    lr : float, optional
        The clients' base lr ``lr0`` (needed only with ``lr_decay_hops``).
    lr_decay_hops : float
        ``t0`` of the decaying lr ``lr0 / sqrt(1 + t / t0)`` sent as ``lr`` at hop ``t``
        (default 0 = off: no ``lr`` in the config, the client's own lr).
    hop_momentum : float
        ``mu`` in [0, 1) of the momentum across hops (default 0 = off).
    average_decay : float
        ``beta`` in [0, 1) of the exponential average of the token, evaluated and exported
        instead of the last iterate (default 0 = off).
    tail_average_from : int
        ``H``: evaluate and export the mean of the tokens from hop ``H`` on instead (default
        0 = off; not with ``average_decay``). These four:
        :mod:`~flwr_isoloco.strategies.graph.rwlora_variants`.
    round_end_fn : callable, optional
        ``fn(server_round, strategy)`` after each round (checkpointing).
    Other keyword arguments as in :class:`GraphStrategy` / Flower's FedAvg.
    """

    what = "rwlora"
    REFUSED_FEDAVG_ARGS = {
        "fraction_train": "RW-LoRA trains exactly one node per round (the walk's vertex)",
        "min_train_nodes": "RW-LoRA trains exactly one node per round (the walk's vertex)",
        "train_metrics_aggr_fn": "a round has one reply, whose metrics are the round's",
    }
    REFUSED_SETTINGS = {
        **GRAPH_REFUSED,
        "Rounds.quorum": ONE_NODE_PER_HOP,
        "Rounds.grace_s": ONE_NODE_PER_HOP,
    }

    def __init__(
        self,
        graph: str | nx.Graph = "complete",
        *,
        num_vertices: int | None = None,
        transition: str = "metropolis",
        target: Any = None,
        lazy: bool = False,
        seed: int = 0,
        start_vertex: Any = None,
        local_steps: int = 1,
        carry_optimizer_state: bool = False,
        optimizer_key: str = "optimizer",
        optimizer_config_key: str = "optimizer-config",
        max_reroutes: int | None = None,
        norm_window: int = 8,
        dead_after: int = 2,
        dead_backoff: int = 8,
        dead_backoff_max: int = 128,
        lr: float | None = None,
        lr_decay_hops: float = 0.0,
        hop_momentum: float = 0.0,
        average_decay: float = 0.0,
        tail_average_from: int = 0,
        checks: ReplyChecks = ReplyChecks(),  # noqa: B008 (frozen)
        rounds: Rounds = Rounds(),  # noqa: B008 (frozen)
        **kwargs: Any,
    ) -> None:
        super().__init__(
            graph,
            num_vertices=num_vertices,
            local_steps=local_steps,
            checks=checks,
            rounds=rounds,
            **kwargs,
        )
        self._init_variants(lr, lr_decay_hops, hop_momentum, average_decay, tail_average_from)
        self.transition = transition
        self.target = target
        self.lazy = bool(lazy)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.seed = int(seed)
        self.start_vertex = start_vertex
        if self.graph is not None:  # clear error before any Flower call (else at setup)
            self._check_graph_options()
        self.carry_optimizer_state = bool(carry_optimizer_state)
        self.optimizer_key = optimizer_key
        self.optimizer_config_key = optimizer_config_key
        if max_reroutes is not None and (not isinstance(max_reroutes, int) or max_reroutes < 0):
            raise ValueError(f"max_reroutes must be an int >= 0, got {max_reroutes!r}")
        self.max_reroutes = max_reroutes
        self.norm_window = int(norm_window)
        self.health = VertexHealth(dead_after, dead_backoff, dead_backoff_max)
        self.transitions: LiveTransitions | None = None
        self._live: LiveMatrix | None = None  # the walk's current matrix (dead set)
        self.relays = 0  # hops the server relayed across a dead vertex
        self._pending_relay = False
        # token and walk state
        self.token: ArrayRecord | None = None
        self.optimizer_state: ArrayRecord | None = None
        self.optimizer_config: ConfigRecord | None = None
        self.P: np.ndarray | None = None
        self.pi: np.ndarray | None = None  # stationary law of P (live vertices)
        self.gap: float | None = None  # absolute spectral gap of P
        self.walk: RandomWalk | None = None
        self.trajectory: list[Any] = []  # vertex of every successful hop
        self._visits: dict[Any, int] = {}
        self.excluded: list[Any] = []  # failed since the last successful hop (re-routing)
        self.failures = 0
        self.failures_by_vertex: dict[Any, int] = {}
        self.failure_log: list[tuple[int, Any, str]] = []  # (round, vertex, reason), last 1000
        self.local_updates = 0
        self.bytes_relayed = 0
        self.bytes_p2p = 0
        self.update_norms: list[float] = []
        self._pending_vertex: Any = None
        self._pending_round = 0
        self._ledger = SentLedger()

    def _check_graph_options(self) -> None:
        """Transition, target and start vertex must fit the graph (``ValueError`` naming them)."""
        G = self.graph
        subgraph_transition(G, G.nodes, self.transition, target=self.target, lazy=self.lazy)
        if self.start_vertex is not None and self.start_vertex not in G:
            raise ValueError(f"start_vertex {self.start_vertex!r} is not a graph vertex")

    def summary(self) -> None:
        G = self.graph
        log(
            INFO,
            "\t├──> graph: %s; transition %s%s",
            graph_summary(self._graph_spec, G),
            self.transition,
            " (lazy)" if self.lazy else "",
        )
        log(
            INFO,
            "\t└──> K=%d local steps per visit, seed %d, carry optimizer state: %s; "
            "lr decay t0 %g, hop momentum %g, average decay %g",
            self.local_steps,
            self.seed,
            self.carry_optimizer_state,
            self.lr_decay_hops,
            self.hop_momentum,
            self.average_decay,
        )

    # ----------------------------------------------------------------- setup
    def _on_setup(self) -> None:
        G = self.live_graph  # the graph's vertices that have a node
        self.P = subgraph_transition(self.graph, G.nodes, self.transition, self.target, self.lazy)
        target = restrict_target(self.graph, self.target, G.nodes)
        self.transitions = LiveTransitions(G, self.transition, target, self.lazy)
        self._live = self.transitions.get(())
        self.pi = self._live.pi.copy()
        self.gap = spectral_gap(self.P)
        start = self.start_vertex if self.start_vertex in G else None
        self.walk = RandomWalk(self.P, vertex_list(G), seed=self.seed, start=None)
        if start is not None:
            self.walk.initial = np.array([1.0 if v == start else 0.0 for v in vertex_list(G)])
        log(
            INFO,
            "%s: walk on %d vertices, spectral gap %.4f, stationary %s",
            self.what,
            G.number_of_nodes(),
            self.gap,
            np.round(self.pi, 4).tolist(),
        )

    def _init_arrays(self, initial_arrays: ArrayRecord) -> None:
        if self.token is None:
            self.token = _record_of(
                {
                    k: v.float() if v.is_floating_point() else v
                    for k, v in record_tensors(initial_arrays).items()
                }
            )

    def current_arrays(self) -> ArrayRecord:
        """The averaged token when ``average_decay > 0`` (after the first hop), else the token."""
        avg = self.averaged_arrays()
        if avg is not None:
            return avg
        return self.token if self.token is not None else ArrayRecord()

    # ----------------------------------------------------------------- one hop
    def visit_counts(self) -> dict[Any, int]:
        """Successful visits per live vertex (kept incrementally: O(n) per round)."""
        return {v: self._visits.get(v, 0) for v in self.vertices}

    def tv_distance(self) -> float:
        """TV distance of the visit frequencies from the walk's stationary distribution."""
        if not self.trajectory or self.pi is None:
            return float("nan")
        counts = self.visit_counts()
        return total_variation([counts[v] for v in self.vertices], self.pi)

    def _vertex_metric(self, v: Any) -> int:
        return int(v) if isinstance(v, (int, np.integer)) else self.vertices.index(v)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Draw the next vertex on the live graph and address the token to its node.

        First attempt of a round: the current row of the live matrix (dead and offline vertices
        removed, :meth:`_sync_live`). Re-route (``self.excluded`` holds this round's failures):
        the row without the self-loop and the failed vertices, renormalised; only when nothing
        is left does the token train again where it is. Empty if no candidate is left."""
        if self.walk is None:
            self._init_arrays(arrays)
            self.setup(grid)
        if self.token is None:
            self._init_arrays(arrays)
        lm = self._sync_live(server_round, self.offline_vertices(grid))
        v = None if lm is None else self._draw(lm)
        if (
            v is None
            and lm is not None
            and self.walk.position is None
            and self.start_vertex is not None
        ):
            log(
                WARNING,
                "%s: start vertex %r unavailable; first vertex drawn from pi",
                self.what,
                self.start_vertex,
            )
            self.walk.initial = self.pi.copy()
            v = self._draw(lm)
        self._pending_vertex, self._pending_round = v, server_round
        self._pending_relay = v is not None and lm.is_relay(self.walk.position, v)
        if v is None:
            self.excluded = []  # every candidate failed: the next call starts afresh
            return []
        cfg = ConfigRecord(dict(config))
        cfg["server-round"] = server_round
        cfg["local-steps"] = self.local_steps
        cfg["walk-vertex"] = self._vertex_metric(v)
        cfg["carry-optimizer-state"] = self.carry_optimizer_state
        if (lr := self.hop_lr()) is not None:
            cfg["lr"] = lr
        content = RecordDict({self.arrayrecord_key: self.token, self.configrecord_key: cfg})
        if self.carry_optimizer_state and self.optimizer_state is not None:
            content[self.optimizer_key] = self.optimizer_state
            content[self.optimizer_config_key] = self.optimizer_config or ConfigRecord()
        node = self.vmap.node_of[v]
        return self._ledger.remember(
            [Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node)]
        )

    def _sync_live(self, server_round: int, offline: Iterable[Any]) -> LiveMatrix | None:
        """Point the walk at the matrix of the current dead set (dead by back-off, or offline).
        If that would leave no vertex, the back-off is ignored (retry rather than stall);
        ``None`` when every vertex is offline."""
        offline = set(offline)
        dead = self.health.dead(server_round) | offline
        if set(self.vertices) <= dead:
            dead = offline
            if set(self.vertices) <= dead:
                return None
        lm = self.transitions.get(dead)
        if lm is not self._live:
            self.walk.set_transition(lm.P)
            self._live = lm
        return lm

    def _draw(self, lm: LiveMatrix) -> Any:
        pos = self.walk.position
        if not self.excluded:
            return self.walk.draw(exclude=lm.dead)
        v = self.walk.draw(exclude=reroute_exclusions(pos, self.excluded, lm.dead))
        if v is None and pos is not None and pos not in self.excluded and pos not in lm.dead:
            v = pos  # no other live neighbour left: the token trains again where it is
        return v

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Accept the reply as the new token, or keep the old one and mark the vertex failed."""
        ok, metrics = self._accept(list(replies))
        return (self.token if ok else None), MetricRecord(
            {k: v for k, v in metrics.items() if math.isfinite(v)}
        )

    def _accept(self, replies: list[Message]) -> tuple[bool, dict[str, float]]:
        """Count the hop's bytes, check its reply; take it as the token or fail the hop."""
        v = self._pending_vertex
        self._pending_vertex = None
        if v is None:
            return False, {}
        self._count_hop_bytes(v, replies)
        expected = record_tensors(self.token)
        reason, hop = self._check_hop(v, replies, expected)
        if reason is not None:
            self._fail_hop(v, reason)
            return False, {"hop-ok": 0}
        return True, self._take_token(v, expected, *hop)

    # ----------------------------------------------------------------- round
    def _run_round(
        self, grid: Grid, server_round: int, config: ConfigRecord, timeout: float
    ) -> dict[str, float]:
        max_tries = 1 + (
            self.max_reroutes
            if self.max_reroutes is not None
            else max(d for _, d in self.live_graph.degree)
            if self.live_graph.number_of_edges()
            else 0
        )
        relayed0, p2p0, fail0 = self.bytes_relayed, self.bytes_p2p, self.failures
        relays0 = self.relays
        ok, hop_metrics, attempts = False, {}, 0
        self.excluded = []  # each round starts from the full row of the current vertex
        for _ in range(max_tries):
            msgs = list(self.configure_train(server_round, self.token, config, grid))
            if not msgs:
                log(
                    WARNING,
                    "%s: round %d: no neighbour left to try; the token stays",
                    self.what,
                    server_round,
                )
                break
            attempts += 1
            replies = list(grid.send_and_receive(msgs, timeout=timeout))
            ok, hop_metrics = self._accept(replies)
            if ok:
                break
        if not ok:
            self.excluded = []
        visits = len(self.trajectory)
        return {
            **hop_metrics,
            "walk-vertex": self._vertex_metric(self.trajectory[-1]) if ok else -1,
            "hop-ok": int(ok),
            "attempts": attempts,
            "failures": self.failures - fail0,
            "failures-total": self.failures,
            "visits": visits,
            "local-updates": self.local_updates,
            "bytes-relayed": self.bytes_relayed - relayed0,
            "bytes-relayed-total": self.bytes_relayed,
            "bytes-p2p": self.bytes_p2p - p2p0,
            "bytes-p2p-total": self.bytes_p2p,
            "tv-distance": self.tv_distance(),
            "offline-vertices": len(self.offline_vertices(grid)),
            "dead-vertices": len(self.health.dead(server_round)),
            "relays": self.relays - relays0,
            "relays-total": self.relays,
        }

    def _used(self, metrics: Mapping[str, float]) -> int:
        return int(metrics.get("hop-ok", 0))
