"""RW-LoRA: one LoRA adapter (the *token*) random-walks over a graph of clients.

docs/algorithms.md section 4. Each round the token (adapter arrays, plus the optimiser state when
``carry_optimizer_state=True``) goes to exactly one node, the vertex ``v_t`` of the walk; that
node takes K local steps and its reply becomes the new token; the walk then draws ``v_{t+1}``
from ``P[v_t, :]``. Nothing is averaged, so there is no LoRA product-aggregation error.

Message conventions (what a client must implement; engineer E's LoRA client does):

- **QUERY** (once at start, and for node ids never seen before): the server sends
  ``RecordDict({"config": ConfigRecord({"vertex-key": "partition-id"})})``; the client replies
  with a ConfigRecord (or MetricRecord) under any key holding ``{<vertex-key>:
  context.node_config[<vertex-key>]}`` (an int, or a str site name). That maps graph vertices
  to Flower node ids (which are random and new every run).
- **TRAIN** instruction: ``"arrays"``: the adapter, ``name -> fp32 array`` (peft keys);
  ``"config"``: ConfigRecord with ``server-round``, ``local-steps`` (K), ``walk-vertex``,
  ``carry-optimizer-state`` (bool) and the app's ``train_config`` entries (lr, batch size...).
  When carrying optimiser state and the token has one: ``"optimizer"``: ArrayRecord of the
  optimiser tensors and ``"optimizer-config"``: ConfigRecord of its scalars. Suggested layout
  for AdamW: arrays ``"<param>.exp_avg"``, ``"<param>.exp_avg_sq"`` and config ``"step"``
  (int), but the strategy treats both records as opaque and hands them back next hop.
- **TRAIN** reply (FedAvg-style, so FedAvg runs the same client): ``"arrays"``: the updated
  adapter, same keys/shapes (other float dtypes are cast to fp32; ConfigRecord
  ``payload="delta"`` means the arrays are ``old - new`` instead); a MetricRecord with
  ``num-examples`` (optional here) and e.g. ``train_loss``, ``local-steps`` (steps actually
  taken; defaults to K); and, when ``carry-optimizer-state`` was set, the new ``"optimizer"``
  ArrayRecord (+ ``"optimizer-config"``). Missing optimiser state resets it (fresh optimiser).

The token is never lost: an error reply, a timeout or a bad update (validated by
:class:`~flwr_isoloco.strategies.common.ReplyValidator`: keys, shapes, dtype, NaN/inf, update
norm; and :func:`~flwr_isoloco.strategies.wire.check_train_metrics`: ``local-steps``,
``data-cursor``, ``partition-id``) leaves the last good token in place, the failure is counted,
and the walk re-routes: it redraws among the *other* neighbours (the current row without the
self-loop and without the vertices that failed this round, renormalised; the token stays and
trains again only when no other candidate is left), up to ``max_reroutes`` times per round.
A vertex that fails ``dead_after`` consecutive times is dead for a back-off that doubles on
repeated deaths; meanwhile the walk moves on the live graph (same target, relays across dead
vertices where the live graph is disconnected): :mod:`flwr_isoloco.walk`, docs/rwlora.md.

Bytes: ``bytes-relayed`` counts what crossed the wire through the server (instruction down +
reply up, also for failed attempts), ``bytes-p2p`` what a peer-to-peer deployment would send
(one token per hop to a *different* vertex, including failed attempts and relays; a lazy
self-loop stays on the node and costs 0; the first placement costs one token).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import networkx as nx
import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..graphs import (
    RandomWalk,
    spectral_gap,
    total_variation,
    transition_matrix,
    vertex_list,
)
from ..walk import LiveMatrix, LiveTransitions, VertexHealth, reroute_exclusions
from .common import CheckedReply, SentLedger
from .graph_base import GraphStrategy
from .vertices import QUERY_VERTEX_KEY, VertexMap, discover_vertices
from .wire import (
    _config_from_json,
    _config_to_json,
    _record_of,
    _tensors_of,
    check_train_metrics,
    record_nbytes,
)

__all__ = ["GraphStrategy", "RWLoRA", "VertexMap", "discover_vertices", "record_nbytes"]
_REEXPORTED = (QUERY_VERTEX_KEY, _record_of, _tensors_of)  # older imports from this module


# ----------------------------------------------------------------------------- RW-LoRA


class RWLoRA(GraphStrategy):
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
        Ship the optimiser state with the token (module docstring for the record keys).
    max_reroutes : int, optional
        Re-routes per round after a failed hop (default: the maximum degree, i.e. try every
        neighbour); when exhausted the round ends with the token kept where it was.
    max_update_norm, max_norm_ratio : float, optional
        Reject an update ``||token - reply||`` above this bound, or above ``max_norm_ratio``
        times the median of the last ``norm_window`` accepted updates (needs 3 of them).
    dead_after : int
        Consecutive failed hops after which a vertex is dead (default 2; 0 = never dead).
    dead_backoff, dead_backoff_max : int
        Rounds a dead vertex is skipped (default 8), doubling on each new death up to
        ``dead_backoff_max`` (default 128) (:class:`flwr_isoloco.walk.VertexHealth`).
    max_empty_rounds : int
        Consecutive rounds without an accepted hop that stop the run (default 3; 0 = off).
    round_end_fn : callable, optional
        ``fn(server_round, strategy)`` after each round (checkpointing).
    Other keyword arguments as in :class:`GraphStrategy` / Flower's FedAvg.
    """

    what = "rwlora"

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
        max_norm_ratio: float | None = None,
        norm_window: int = 8,
        dead_after: int = 2,
        dead_backoff: int = 8,
        dead_backoff_max: int = 128,
        **kwargs: Any,
    ) -> None:
        super().__init__(graph, num_vertices=num_vertices, local_steps=local_steps, **kwargs)
        self.transition = transition
        self.target = target
        self.lazy = bool(lazy)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.seed = int(seed)
        # validate the transition options now (clear error before any Flower call)
        transition_matrix(self.graph, transition, target=self._target_for(self.graph), lazy=lazy)
        if start_vertex is not None and start_vertex not in self.graph:
            raise ValueError(f"start_vertex {start_vertex!r} is not a graph vertex")
        self.start_vertex = start_vertex
        self.carry_optimizer_state = bool(carry_optimizer_state)
        self.optimizer_key = optimizer_key
        self.optimizer_config_key = optimizer_config_key
        if max_reroutes is not None and (not isinstance(max_reroutes, int) or max_reroutes < 0):
            raise ValueError(f"max_reroutes must be an int >= 0, got {max_reroutes!r}")
        self.max_reroutes = max_reroutes
        if max_norm_ratio is not None and not (
            max_norm_ratio > 0 and math.isfinite(max_norm_ratio)
        ):
            raise ValueError(f"max_norm_ratio must be a finite number > 0, got {max_norm_ratio!r}")
        self.max_norm_ratio = max_norm_ratio
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

    def _target_for(self, G: nx.Graph) -> Any:
        if self.target is None:
            return None
        if isinstance(self.target, Mapping):
            unknown = [v for v in self.target if v not in self.graph]
            if unknown:
                raise ValueError(f"target weights: unknown vertex {unknown[0]!r}")
            return {v: w for v, w in self.target.items() if v in G}
        w = list(self.target)
        full = vertex_list(self.graph)
        if len(w) != len(full):
            raise ValueError(f"target weights: {len(w)} values for {len(full)} vertices")
        return {v: w[i] for i, v in enumerate(full) if v in G}

    def summary(self) -> None:
        log(
            INFO,
            "\t├──> graph: %d vertices, %d edges; transition %s%s",
            self.graph.number_of_nodes(),
            self.graph.number_of_edges(),
            self.transition,
            " (lazy)" if self.lazy else "",
        )
        log(
            INFO,
            "\t└──> K=%d local steps per visit, seed %d, carry optimizer state: %s",
            self.local_steps,
            self.seed,
            self.carry_optimizer_state,
        )

    # ----------------------------------------------------------------- setup
    def _on_setup(self) -> None:
        G = self.live_graph
        self.P = transition_matrix(G, self.transition, target=self._target_for(G), lazy=self.lazy)
        self.transitions = LiveTransitions(G, self.transition, self._target_for(G), self.lazy)
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
                    for k, v in _tensors_of(initial_arrays).items()
                }
            )

    def current_arrays(self) -> ArrayRecord:
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

    def _check_optimizer(self, content: RecordDict) -> tuple[ArrayRecord | None, str | None]:
        rec = content.array_records.get(self.optimizer_key)
        if rec is None:
            return None, None
        prev = _tensors_of(self.optimizer_state) if self.optimizer_state is not None else None
        tensors = _tensors_of(rec)
        if prev is not None and set(prev) != set(tensors):
            return None, "optimizer state keys differ from the previous hop's"
        for k, t in tensors.items():
            if not t.is_floating_point() and t.dtype not in (torch.int32, torch.int64):
                return None, f"optimizer array {k!r} has dtype {t.dtype}"
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return None, f"optimizer array {k!r} has non-finite values"
            if prev is not None and tuple(prev[k].shape) != tuple(t.shape):
                return None, f"optimizer array {k!r} has shape {tuple(t.shape)}"
        return rec, None

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Accept the reply as the new token, or keep the old one and mark the vertex failed."""
        ok, metrics = self._accept(list(replies))
        return (self.token if ok else None), MetricRecord(
            {k: v for k, v in metrics.items() if math.isfinite(v)}
        )

    def _accept(self, replies: list[Message]) -> tuple[bool, dict[str, float]]:
        v = self._pending_vertex
        self._pending_vertex = None
        if v is None:
            return False, {}
        sent = record_nbytes(self.token)
        if self.carry_optimizer_state:
            sent += record_nbytes(self.optimizer_state)
        moved = self.walk.position != v  # a lazy self-loop stays on the node in P2P
        self.bytes_relayed += sent
        self.bytes_p2p += sent if moved else 0
        for r in replies:
            if r.has_content():
                self.bytes_relayed += record_nbytes(*r.content.array_records.values())
        expected = _tensors_of(self.token)
        checked, report = self.validator.validate(replies[:1], expected, self._ledger)
        reason = None
        if not replies:
            reason = "no reply (timeout)"
        elif len(replies) > 1:
            log(WARNING, "%s: %d replies for one hop; using the first", self.what, len(replies))
        if checked:
            reply: CheckedReply = checked[0]
            reason = check_train_metrics(
                reply.content, asked_steps=self.local_steps, vertex=v, vertex_key=self.vertex_key
            )
            update = reply.update(expected)
            norm = math.sqrt(sum(float(u.double().pow(2).sum()) for u in update.values()))
            recent = self.update_norms[-self.norm_window :]
            if (
                reason is None
                and self.max_norm_ratio is not None
                and len(recent) >= 3
                and norm > self.max_norm_ratio * statistics.median(recent)
            ):
                reason = (
                    f"update norm {norm:.4g} > max_norm_ratio {self.max_norm_ratio:g} x median "
                    f"of the last {len(recent)} accepted updates {statistics.median(recent):.4g}"
                )
            opt_rec, opt_err = (None, None)
            if reason is None and self.carry_optimizer_state:
                opt_rec, opt_err = self._check_optimizer(reply.content)
                if opt_err is not None:
                    reason = opt_err
        elif reason is None:
            reason = report.reasons[0][1] if report.reasons else "reply rejected"
        node = self.vmap.node_of.get(v)
        if reason is not None:
            self.failures += 1
            self.failures_by_vertex[v] = self.failures_by_vertex.get(v, 0) + 1
            self.excluded.append(v)
            self.failure_log = [*self.failure_log[-999:], (self._pending_round, v, reason)]
            log(
                WARNING,
                "%s: round %s: hop to vertex %r (node %s) failed: %s; token kept, re-routing",
                self.what,
                self._pending_round,
                v,
                node,
                reason,
            )
            period = self.health.record_failure(v, self._pending_round)
            if period is not None:
                log(
                    WARNING,
                    "%s: vertex %r (node %s) is dead (death %d in a row): skipped for %d rounds "
                    "(until round %d); the walk moves on the live graph",
                    self.what,
                    v,
                    node,
                    self.health.strikes[v],
                    period,
                    self.health.dead_until[v],
                )
            return False, {"hop-ok": 0}
        # success: the reply is the new token
        if reply.payload == "delta":
            new = {k: expected[k].float() - update[k] for k in expected}
        else:
            new = {k: t.float() for k, t in reply.tensors().items()}
        self.token = _record_of({k: new[k] for k in expected})
        if self.carry_optimizer_state:
            if opt_rec is None:
                log(WARNING, "%s: vertex %r sent no optimizer state; it is reset", self.what, v)
                self.optimizer_state, self.optimizer_config = None, None
            else:
                self.optimizer_state = opt_rec
                cfg = reply.content.config_records.get(self.optimizer_config_key)
                self.optimizer_config = ConfigRecord(dict(cfg)) if cfg is not None else None
        self.walk.move_to(v)
        self.health.record_success(v)
        self.relays += int(self._pending_relay)
        self.trajectory.append(v)
        self._visits[v] = self._visits.get(v, 0) + 1
        self.excluded = []
        self.update_norms.append(norm)
        self.update_norms = self.update_norms[-self.norm_window :]
        self.local_updates += int(reply.metrics.get("local-steps", self.local_steps))  # checked
        client = {
            k: float(x) for k, x in reply.metrics.items() if k not in ("local-steps", "walk-vertex")
        }
        return True, {**client, "hop-ok": 1, "update-norm": norm, "relay": int(self._pending_relay)}

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

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """``{"tensors": {"token", "optimizer"}, "meta": JSON-able}``: pass ``tensors`` and
        ``meta`` to :func:`flwr_isoloco.checkpoint.save_checkpoint` as they are."""
        if self.walk is None:
            raise ValueError("rwlora: state_dict() before the walk was set up (call start first)")
        return {
            "tensors": {
                "token": _tensors_of(self.token),
                "optimizer": _tensors_of(self.optimizer_state),
            },
            "meta": {
                "kind": self.what,
                "round": self.round,
                "vertices": self.vertices,
                "walk": self.walk.state_dict(),
                "trajectory": list(self.trajectory),
                "excluded": list(self.excluded),
                "failures": self.failures,
                "failures_by_vertex": [[v, n] for v, n in self.failures_by_vertex.items()],
                "failure_log": [list(x) for x in self.failure_log],
                "local_updates": self.local_updates,
                "bytes_relayed": self.bytes_relayed,
                "bytes_p2p": self.bytes_p2p,
                "update_norms": list(self.update_norms),
                "health": self.health.state_dict(),
                "relays": self.relays,
                "empty_streak": self.guard.streak,
                "optimizer_config": (
                    None
                    if self.optimizer_config is None
                    else _config_to_json(self.optimizer_config)
                ),
            },
        }

    def _check_state_tensors(
        self,
        tensors: Mapping[str, Any],
        meta: Mapping[str, Any],
        reference: Any,
        optimizer_reference: Any = None,
    ) -> None:
        """Token: finite, non-empty, the names and shapes of ``reference`` (the adapter) when
        given. Optimizer state (opaque to the strategy): finite float or int tensors, with the
        names and shapes of ``optimizer_reference`` when given and the state is not empty."""
        from flwr_isoloco.checkpoint_spec import CheckpointError, Field, check_fields, check_tensors

        check_fields(
            dict(meta),
            {
                "walk": Field("dict"),
                "trajectory": Field("list"),
                "excluded": Field("list"),
                "update_norms": Field("list", items=Field("float", min=0)),
                "optimizer_config": Field("dict", nullable=True, optional=True),
                "health": Field(
                    "dict",
                    optional=True,
                    fields=dict.fromkeys(
                        ("streak", "strikes", "dead_until"),
                        Field("list", items=Field("list", length=2)),
                    ),
                ),
                "relays": Field("int", min=0, optional=True),
            },
        )
        token = tensors.get("token")
        check_tensors(token, reference, "token")
        if not token:
            raise CheckpointError("tensor group 'token' is empty")
        opt = tensors.get("optimizer") or {}
        check_tensors(opt, optimizer_reference if opt else None, "optimizer")
        for key, t in opt.items():
            if not t.is_floating_point() and t.dtype not in (torch.int32, torch.int64):
                raise CheckpointError(f"tensor 'optimizer/{key}' has dtype {t.dtype}")

    def _preload_state(self, state: Mapping[str, Any]) -> None:
        token = state["tensors"].get("token") or {}
        if not token:
            raise ValueError("rwlora state has no token tensors")
        self.token = _record_of(token)

    def _apply_state(self, state: Mapping[str, Any]) -> None:
        meta, tensors = state["meta"], state["tensors"]
        if list(meta["vertices"]) != self.vertices:
            raise ValueError(
                f"rwlora: checkpoint walked vertices {meta['vertices']} but the live vertices are "
                f"{self.vertices}; cannot resume the same walk"
            )
        self._preload_state(state)
        opt = tensors.get("optimizer") or {}
        self.optimizer_state = _record_of(opt) if opt else None
        oc = meta.get("optimizer_config")
        self.optimizer_config = None if oc is None else _config_from_json(oc)
        self.walk.load_state_dict(meta["walk"])
        self.round = int(meta["round"])
        self.trajectory = list(meta["trajectory"])
        self._visits = {}
        for v in self.trajectory:
            self._visits[v] = self._visits.get(v, 0) + 1
        self.excluded = list(meta["excluded"])
        self.failures = int(meta["failures"])
        self.failures_by_vertex = {v: int(n) for v, n in meta["failures_by_vertex"]}
        self.failure_log = [(int(r), v, str(why)) for r, v, why in meta.get("failure_log", [])]
        self.local_updates = int(meta["local_updates"])
        self.bytes_relayed = int(meta["bytes_relayed"])
        self.bytes_p2p = int(meta["bytes_p2p"])
        self.update_norms = [float(x) for x in meta["update_norms"]]
        if "health" in meta:  # absent in checkpoints written before dead-vertex handling
            self.health.load_state_dict(meta["health"], self.vertices)
        self.relays = int(meta.get("relays", 0))
        self.guard.streak = int(meta.get("empty_streak", 0))
