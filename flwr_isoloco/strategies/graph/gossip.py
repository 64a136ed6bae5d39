"""Gossip LoRA: the decentralised-SGD baseline of RW-LoRA (section 4 of
the repository's ``docs/algorithms.md`` ("Algorithms")).

Every vertex keeps its own adapter ``x_i`` (held by the server, sent to the vertex's node each
round). Each round every node takes K local steps from its ``x_i``; then each adapter becomes
the Metropolis-weighted mix of its neighbours' (``x_i <- sum_j W_ij x_j``, ``W_ij = 1/(1 +
max(d_i, d_j))`` on edges, ``W_ii = 1 - sum_j W_ij``; symmetric, doubly stochastic).
Evaluation: ``current_arrays`` returns the vertex average ``mean_i x_i``, which averages the A
and B factors separately (``mean_i B_i A_i`` is not ``mean_i B_i mean_i A_i``: the LoRA
product-aggregation error RW-LoRA avoids, and a handicap for gossip);
:meth:`GossipLoRA.vertex_adapters` gives each vertex's own adapter, so an app can also report
the mean of the per-vertex accuracies (the rwlora_sentiment app reports both).

Messages are those of :mod:`flwr_isoloco.strategies.graph.rwlora` (QUERY round to map vertices to
nodes; TRAIN with ``arrays`` + ``config`` holding ``local-steps`` and ``walk-vertex`` = the
vertex; FedAvg-style replies). No optimiser state travels (``carry-optimizer-state`` is False):
gossip nodes keep their own optimiser locally, if any.

A node that errors, times out (or misses a round closed on ``Rounds(quorum, grace_s)``) or returns
a bad update keeps its previous adapter (it did not train this round) and that copy still
enters the mixing step, as the last copy its neighbours received. Accounting per round: ``local-updates`` K per node that trained (``n K`` when all
do); ``bytes-relayed`` what crossed the wire via the server (n adapters down + the replies up);
``bytes-p2p`` what a peer-to-peer deployment sends: each edge carries one adapter each way,
``2 |E|`` adapters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import networkx as nx
import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_isoloco.graphs import consensus_distance, metropolis_mixing_weights, mix, spectral_gap
from flwr_isoloco.merging.weights import norm_outlier
from flwr_isoloco.strategies.core.ledger import SentLedger
from flwr_isoloco.strategies.core.metrics import weighted_mean_metrics
from flwr_isoloco.strategies.core.replies import ReplyReport
from flwr_isoloco.strategies.core.stream import ReplyStream
from flwr_isoloco.strategies.core.wire import (
    _record_of,
    check_train_metrics,
    record_nbytes,
    record_tensors,
)
from flwr_isoloco.strategies.graph.base import GraphStrategy, graph_summary
from flwr_isoloco.strategies.graph.settings import ReplyChecks, Rounds

__all__ = ["GossipLoRA", "mix"]


class GossipLoRA(GraphStrategy):
    """Gossip / decentralised SGD on LoRA adapters with Metropolis mixing (Message API).

    Parameters
    ----------
    graph, num_vertices, graph_seed, vertex_key, local_steps :
        As in :class:`~flwr_isoloco.strategies.RWLoRA`.
    checks : ReplyChecks
        ``max_update_norm`` / ``max_norm_ratio``: reject a reply whose ``||x_i - reply||``
        exceeds this / this times the median of the round's other accepted ones (needs 2).
    rounds : Rounds
        ``quorum`` / ``grace_s``: close a round once ``quorum`` of the vertices sent to have
        replied (a fraction in (0, 1], rounded up, or an int count >= 2; None = all) and
        ``grace_s`` seconds more have passed (``timeout`` stays the cap); a vertex whose reply
        is not in keeps its adapter, as on a timeout. ``max_empty_rounds`` as in RW-LoRA.
        Fields gossip does not use are refused (``REFUSED_SETTINGS``).
    round_end_fn : callable, optional
        ``fn(server_round, strategy)`` after each round (checkpointing).
    """

    what = "gossip"
    REFUSED_FEDAVG_ARGS = {
        "fraction_train": "gossip trains every live vertex every round",
        "min_train_nodes": "gossip trains every live vertex every round",
        "train_metrics_aggr_fn": "gossip's train metrics are its own mixing and byte accounting",
    }

    def __init__(
        self,
        graph: str | nx.Graph = "complete",
        *,
        num_vertices: int | None = None,
        local_steps: int = 1,
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
        self._train_stream = ReplyStream(self.what)
        self.initial: dict[str, torch.Tensor] | None = None
        self.adapters: dict[Any, dict[str, torch.Tensor]] = {}
        self.W: np.ndarray | None = None
        self.failures = 0
        self.failures_by_vertex: dict[Any, int] = {}
        self.failure_log: list[tuple[int, Any, str]] = []
        self.local_updates = 0
        self.bytes_relayed = 0
        self.bytes_p2p = 0
        self._ledger = SentLedger()
        self._sent_vertex: dict[int, Any] = {}

    def summary(self) -> None:
        G = self.graph
        log(
            INFO,
            "\t└──> gossip: graph %s; K=%d local steps; Metropolis mixing",
            graph_summary(self._graph_spec, G),
            self.local_steps,
        )

    # ----------------------------------------------------------------- setup / arrays
    def _init_arrays(self, initial_arrays: ArrayRecord) -> None:
        if self.initial is None:
            self.initial = {
                k: (v.float() if v.is_floating_point() else v)
                for k, v in record_tensors(initial_arrays).items()
            }

    def _on_setup(self) -> None:
        self.W = metropolis_mixing_weights(self.live_graph)
        self._ensure_adapters()
        log(
            INFO,
            "gossip: %d vertices, mixing spectral gap %.4f",
            len(self.vertices),
            spectral_gap(self.W),
        )

    def _ensure_adapters(self) -> None:
        """Every live vertex without an adapter starts from the initial one."""
        if self.initial is None or self.live_graph is None:
            return
        for v in self.vertices:
            if v not in self.adapters:
                self.adapters[v] = {k: t.clone() for k, t in self.initial.items()}

    def average(self) -> dict[str, torch.Tensor]:
        """Vertex average ``mean_i x_i`` (fp64 accumulation)."""
        xs = [self.adapters[v] for v in self.vertices]
        return {k: torch.stack([x[k].double() for x in xs]).mean(0).float() for k in xs[0]}

    def current_arrays(self) -> ArrayRecord:
        self._ensure_adapters()
        if self.adapters:
            return _record_of(self.average())
        return _record_of(self.initial) if self.initial is not None else ArrayRecord()

    def consensus_distance(self) -> float:
        """``sqrt(mean_i ||x_i - xbar||^2)``: how far the vertices are from agreeing."""
        return consensus_distance([self.adapters[v] for v in self.vertices])

    # ----------------------------------------------------------------- Flower API
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per live vertex, carrying that vertex's adapter."""
        self._init_arrays(arrays)
        if self.live_graph is None:
            self.setup(grid)
        self._ensure_adapters()
        msgs = []
        self._sent_vertex = {}
        offline = set(self.offline_vertices(grid))
        for v in self.vertices:
            if v in offline:  # not listed by the grid: keeps its adapter (counted at aggregate)
                continue
            node = self.vmap.node_of[v]
            cfg = ConfigRecord(dict(config))
            cfg["server-round"] = server_round
            cfg["local-steps"] = self.local_steps
            cfg["walk-vertex"] = int(v) if isinstance(v, int) else self.vertices.index(v)
            cfg["carry-optimizer-state"] = False
            content = RecordDict(
                {self.arrayrecord_key: _record_of(self.adapters[v]), self.configrecord_key: cfg}
            )
            msgs.append(Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node))
            self._sent_vertex[node] = v
        self._round = server_round
        return self._ledger.remember(msgs)

    def _fail(self, v: Any, reason: str) -> None:
        self.failures += 1
        self.failures_by_vertex[v] = self.failures_by_vertex.get(v, 0) + 1
        self.failure_log = [*self.failure_log[-999:], (self._round, v, reason)]
        log(
            WARNING,
            "gossip: round %d: vertex %r (node %s) keeps its previous adapter: %s",
            self._round,
            v,
            self.vmap.node_of.get(v) if self.vmap is not None else None,
            reason,
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Take each valid reply as its vertex's new adapter (failed vertices keep theirs),
        then mix with ``W``. Returns the vertex average."""
        replies = list(replies)
        self._round = server_round
        fail0 = self.failures
        sent = set(self._sent_vertex.values())
        down = sum(record_nbytes(_record_of(self.adapters[v])) for v in self.vertices if v in sent)
        up = sum(
            record_nbytes(*r.content.array_records.values()) for r in replies if r.has_content()
        )
        by_vertex: dict[Any, list[Message]] = {}
        for r in replies:
            v = self._sent_vertex.get(self._ledger.sender(r))
            if v is None:
                log(
                    WARNING, "gossip: reply from node %d we did not send to", r.metadata.src_node_id
                )
                continue
            by_vertex.setdefault(v, []).append(r)
        trained, accepted = self._trained(by_vertex, sent)
        answered = [v for v in self.vertices if v in sent and by_vertex.get(v)]
        self.validator.log_summary(  # one line per round (each vertex is checked alone)
            ReplyReport(
                used=len(accepted),
                rejected=len(answered) - len(accepted),
                missing=len(sent) - len(answered),
            ),
            server_round,
        )
        steps_done = 0
        self.round_replies = [(v, dict(r.metrics)) for v, r in accepted]
        for _, reply in accepted:  # local-steps checked in [0, K] by check_train_metrics
            steps_done += int(reply.metrics.get("local-steps", self.local_steps))
        before_mix = [trained.get(v, self.adapters[v]) for v in self.vertices]
        mixed = mix(self.W, before_mix)
        self.adapters = dict(zip(self.vertices, mixed, strict=True))
        self.local_updates += steps_done
        self.bytes_relayed += down + up
        p2p = 2 * self.live_graph.number_of_edges() * record_nbytes(_record_of(self.initial))
        self.bytes_p2p += p2p
        client = weighted_mean_metrics(
            [r for _, r in accepted],
            exclude=("local-steps", "walk-vertex", "partition-id", "data-cursor"),
        )
        metrics = {
            **client,
            "trained": len(accepted),
            "failures": self.failures - fail0,
            "failures-total": self.failures,
            "local-updates": self.local_updates,
            "bytes-relayed": down + up,
            "bytes-relayed-total": self.bytes_relayed,
            "bytes-p2p": p2p,
            "bytes-p2p-total": self.bytes_p2p,
            "consensus-distance": self.consensus_distance(),
        }
        return self.current_arrays(), MetricRecord(
            {k: v for k, v in metrics.items() if math.isfinite(v)}
        )

    def _trained(
        self, by_vertex: Mapping[Any, list[Message]], sent: set[Any]
    ) -> tuple[dict[Any, dict[str, torch.Tensor]], list[tuple[Any, Any]]]:
        """Each vertex's new adapter from its valid reply, and the accepted ``(vertex, reply)``.

        A vertex not sent to, without a reply, with a reply the validator or
        check_train_metrics refuses, or whose ``||update|| > max_norm_ratio x`` the median of
        the others' (needs 2 others) keeps its adapter (:meth:`_fail`)."""
        trained: dict[Any, dict[str, torch.Tensor]] = {}
        norms: dict[Any, float] = {}
        accepted = []
        for v in self.vertices:
            got = by_vertex.get(v, [])
            if v not in sent:
                self._fail(v, "node offline (not listed by the grid); nothing sent")
                continue
            if not got:
                self._fail(v, "no reply (timeout)")
                continue
            checked, report = self.validator.validate(
                got[:1], self.adapters[v], None, log_summary=False
            )
            if not checked:
                self._fail(v, report.reasons[0][1] if report.reasons else "reply rejected")
                continue
            reply = checked[0]
            bad = check_train_metrics(
                reply.content,
                asked_steps=self.local_steps,
                vertex=v,
                vertex_key=self.checked_vertex_key,
            )
            if bad is not None:
                self._fail(v, bad)
                continue
            update = reply.update(self.adapters[v])
            trained[v] = {k: self.adapters[v][k].float() - update[k] for k in self.adapters[v]}
            norms[v] = reply.update_norm  # tensor_norm(update), fp64, set by the validator
            accepted.append((v, reply))
        if ratio := self.checks.max_norm_ratio:
            for v in list(trained):
                others = [n for u, n in norms.items() if u != v and u in trained]
                reason = norm_outlier(norms[v], others, ratio, min_reference=2)
                if reason is not None:
                    self._fail(v, reason)
                    del trained[v]
            accepted = [(v, r) for v, r in accepted if v in trained]
        return trained, accepted

    def _used(self, metrics: Mapping[str, float]) -> int:
        return int(metrics.get("trained", 0))

    def vertex_adapters(self) -> dict[Any, ArrayRecord]:
        """Each live vertex's own adapter ``x_i`` (after the last mixing step)."""
        self._ensure_adapters()
        return {v: _record_of(self.adapters[v]) for v in self.vertices}

    def _run_round(
        self, grid: Grid, server_round: int, config: ConfigRecord, timeout: float
    ) -> dict[str, float]:
        msgs = list(self.configure_train(server_round, self.current_arrays(), config, grid))
        replies: list[Message] = []
        wait = self._train_stream.run(
            grid,
            msgs,
            replies.append,
            server_round=server_round,
            timeout=timeout,
            quorum=self.rounds.closing_quorum,
            grace_s=self.rounds.grace_s,
        )
        del msgs
        _, metrics = self.aggregate_train(server_round, replies)
        return {**dict(metrics), **wait.as_metrics()}

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """``{"tensors": {"adapters": {str(vertex): adapter}}, "meta": JSON-able}``."""
        if self.live_graph is None:
            raise ValueError("gossip: state_dict() before setup (call start first)")
        return {
            "tensors": {"adapters": {str(v): dict(self.adapters[v]) for v in self.vertices}},
            "meta": {
                "kind": self.what,
                "round": self.round,
                "vertices": self.vertices,
                **self._ledger_meta(),
                "empty_streak": self.guard.streak,
            },
        }

    def _check_state_tensors(
        self,
        tensors: Mapping[str, Any],
        meta: Mapping[str, Any],
        reference: Any,
        optimizer_reference: Any = None,
    ) -> None:
        """One finite adapter per vertex, each with the names and shapes of ``reference`` (the
        model's adapter) when given, else of the first vertex's."""
        from flwr_isoloco.checkpoint.spec import CheckpointError, check_tensors

        adapters = tensors.get("adapters")
        if not isinstance(adapters, Mapping) or not adapters:
            raise CheckpointError("tensor group 'adapters' is missing or empty")
        first = next(iter(adapters.values()))
        for v, adapter in adapters.items():
            check_tensors(adapter, reference, f"adapters/{v}")
            check_tensors(adapter, first, f"adapters/{v}")

    def _preload_state(self, state: Mapping[str, Any]) -> None:
        adapters = state["tensors"].get("adapters") or {}
        if not adapters:
            raise ValueError("gossip state has no adapters")
        first = next(iter(adapters.values()))
        self.initial = {k: torch.zeros_like(t) for k, t in first.items()}

    def _apply_state(self, state: Mapping[str, Any]) -> None:
        meta, adapters = state["meta"], state["tensors"]["adapters"]
        if list(meta["vertices"]) != self.vertices:
            raise ValueError(
                f"gossip: checkpoint has vertices {meta['vertices']} but the live vertices are "
                f"{self.vertices}; cannot resume"
            )
        missing = [v for v in self.vertices if str(v) not in adapters]
        if missing:
            raise ValueError(f"gossip state: no adapter for vertex {missing[0]!r}")
        self.adapters = {
            v: {k: t.float().clone() for k, t in adapters[str(v)].items()} for v in self.vertices
        }
        self.round = int(meta["round"])
        self._load_ledger(meta)
        self.guard.streak = int(meta.get("empty_streak", 0))
