"""The base class of the graph strategies (RW-LoRA, gossip): graph, vertex discovery, the round
loop with resume, server-side evaluation, a per-round callback and the empty-round guard."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import networkx as nx
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_isoloco.graphs import build_graph, deferred_graph, vertex_list
from flwr_isoloco.strategies.core.evaluation import (
    FederatedEvaluation,
    check_count,
    evaluation_round,
    rng_from_json,
)
from flwr_isoloco.strategies.core.guard import EmptyRoundGuard, NoProgressError
from flwr_isoloco.strategies.core.lifecycle import ResumableStrategy, RoundOutcome
from flwr_isoloco.strategies.core.nodes import wait_for_nodes
from flwr_isoloco.strategies.core.replies import ReplyValidator
from flwr_isoloco.strategies.core.stream import ReplyStream
from flwr_isoloco.strategies.graph.settings import (
    GRAPH_REFUSED,
    ReplyChecks,
    Rounds,
    check_settings,
    moved_keyword,
)
from flwr_isoloco.strategies.graph.vertices import (
    VertexMap,
    assign_new_nodes,
    discover_vertices,
    map_vertices,
)

__all__ = ["GraphStrategy", "graph_summary"]

SETTLE_S = 2.0
"""Seconds the node count must stay unchanged before a deferred graph is built on it."""


def graph_summary(spec: Any, G: nx.Graph | None) -> str:
    """The graph for the start-up summary: its size, or (a family without ``n``, built on the
    nodes connected at start) its name and when it is built."""
    if G is None:
        return f"{spec!r} on the connected nodes (one vertex per node, built when they are in)"
    return f"{G.number_of_nodes()} vertices, {G.number_of_edges()} edges"


class GraphStrategy(ResumableStrategy):
    """Shared plumbing of the graph strategies (RW-LoRA, gossip): graph, vertex discovery,
    the round loop with resume (``start`` runs rounds ``self.round + 1 .. num_rounds``),
    server-side evaluation and a per-round callback (for checkpoints).

    Keyword arguments shared by both: ``num_vertices`` / ``graph_seed`` (for
    :func:`~flwr_isoloco.graphs.build_graph`), ``vertex_key`` (node_config key the clients
    answer, default ``partition-id``), ``local_steps`` (K), ``node_wait_s`` (how long to wait
    for one node per vertex before the QUERY round, default 60 s), ``query_timeout`` (default:
    the ``timeout`` given to ``start``), ``query_attempts`` (QUERY retries for silent nodes,
    default 3; nodes that never answer are left out), ``arrayrecord_key`` /
    ``configrecord_key`` / ``weighted_by_key`` (as FedAvg), ``fraction_evaluate`` (default
    1.0 as FedAvg: every round the current model is evaluated on the live vertices' nodes, so
    a swapped FedAvg app keeps its federated evaluation; 0 = server-side ``evaluate_fn``
    only), ``min_evaluate_nodes``, ``require_weight`` (default False), ``round_end_fn``,
    ``checks=ReplyChecks(...)`` and ``rounds=Rounds(...)`` (DiLoCo's classes; what a graph does
    not use is refused: :mod:`~flwr_isoloco.strategies.graph.settings`): ``max_empty_rounds``
    (default 3) consecutive rounds in which no reply was used stop :meth:`start` with
    :class:`~flwr_isoloco.strategies.core.guard.NoProgressError` (0 = off).
    """

    what = "graph-strategy"
    REFUSED_FEDAVG_ARGS: dict[str, str] = {}
    """FedAvg keyword arguments that have no meaning for this strategy, with the reason."""
    REFUSED_SETTINGS: dict[str, str] = GRAPH_REFUSED
    """``"Class.field"`` of ``checks`` / ``rounds`` with no meaning here, with the reason."""

    def __init__(
        self,
        graph: str | nx.Graph = "complete",
        *,
        num_vertices: int | None = None,
        graph_seed: int | None = 0,
        vertex_key: str = "partition-id",
        local_steps: int = 1,
        node_wait_s: float = 60.0,
        query_timeout: float | None = None,
        query_attempts: int = 3,
        fraction_evaluate: float = 1.0,
        min_evaluate_nodes: int = 1,
        min_available_nodes: int = 0,
        evaluate_metrics_aggr_fn: Callable[..., MetricRecord] | None = None,
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        weighted_by_key: str = "num-examples",
        require_weight: bool = False,
        round_end_fn: Callable[[int, GraphStrategy], None] | None = None,
        checks: ReplyChecks = ReplyChecks(),  # noqa: B008 (frozen)
        rounds: Rounds = Rounds(),  # noqa: B008 (frozen)
        **fedavg_args: Any,
    ) -> None:
        self._refuse(fedavg_args)
        self.checks, self.rounds = check_settings(self, checks, rounds)
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(f"local_steps must be an int >= 1, got {local_steps!r}")
        if not vertex_key or not isinstance(vertex_key, str):
            raise ValueError(f"vertex_key must be a non-empty str, got {vertex_key!r}")
        self._graph_spec, self._graph_seed = graph, graph_seed
        # A named family without n ("complete", "ring", ...) gets n = the connected nodes.
        self.graph: nx.Graph | None = (
            None
            if deferred_graph(graph, num_vertices)
            else build_graph(graph, num_vertices, graph_seed)
        )
        self.vertex_key = vertex_key
        self.local_steps = local_steps
        self.node_wait_s = float(node_wait_s)
        self.query_timeout = query_timeout
        check_count("query_attempts", query_attempts, minimum=1)
        self.query_attempts = query_attempts
        self.min_available_nodes = check_count("min_available_nodes", min_available_nodes)
        self.evaluation = FederatedEvaluation(
            fraction_evaluate,
            min_evaluate_nodes,
            seed=int(graph_seed or 0),
            arrayrecord_key=arrayrecord_key,
            configrecord_key=configrecord_key,
            weighted_by_key=weighted_by_key,
            aggr_fn=evaluate_metrics_aggr_fn,
            what=f"{self.what} evaluate",
        )
        self.fraction_evaluate = self.evaluation.fraction
        self._eval_stream = ReplyStream(f"{self.what} evaluate")
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.weighted_by_key = weighted_by_key
        self.round_end_fn = round_end_fn
        self.guard = EmptyRoundGuard(rounds.max_empty_rounds, self.what)
        self.validator = ReplyValidator(  # max_norm_ratio: per strategy (a hop, a vertex)
            arrayrecord_key=arrayrecord_key,
            weighted_by_key=weighted_by_key,
            require_weight=require_weight,
            dtype_policy=checks.dtype_policy,
            max_update_norm=checks.max_update_norm or None,
            default_payload=checks.payload,
            what=self.what,
        )
        self.vmap: VertexMap | None = None
        self.live_graph: nx.Graph | None = None
        self.missing_vertices: list[Any] = []
        self.round = 0  # rounds completed
        self.history: list[dict[str, float]] = []
        # (vertex, scalar metrics) of every reply that entered the model this round, checked
        # by check_train_metrics against its vertex: for apps (e.g. per-partition data cursors)
        self.round_replies: list[tuple[Any, dict[str, float]]] = []
        self._pending_state: dict[str, Any] | None = None

    def _refuse(self, fedavg_args: Mapping[str, Any]) -> None:
        """``TypeError`` for a keyword this strategy does not take, saying why for FedAvg's and
        naming the new spelling for a setting's field (``quorum=`` -> ``rounds=Rounds(...)``)."""
        for name, value in fedavg_args.items():
            cls = type(self).__name__
            why = self.REFUSED_FEDAVG_ARGS.get(name)
            if why is not None:
                raise TypeError(f"{cls}: FedAvg's {name}= has no meaning here: {why}")
            moved = moved_keyword(cls, name, value, self.REFUSED_SETTINGS)
            if moved is not None:
                raise TypeError(moved)
            raise TypeError(f"{cls}() got an unexpected keyword argument {name!r}")

    # ----------------------------------------------------------------- vertices
    @property
    def vertices(self) -> list[Any]:
        """Live vertices (after discovery), else all graph vertices ([] before a deferred
        graph is built)."""
        G = self.live_graph if self.live_graph is not None else self.graph
        return [] if G is None else vertex_list(G)

    @property
    def checked_vertex_key(self) -> str:
        """The node_config key a reply's ``partition-id`` metric must match ("" when vertices
        were assigned in node-id order: then a partition id says nothing about the vertex)."""
        return "" if self.vmap is not None and self.vmap.by_node_order else self.vertex_key

    def setup(self, grid: Grid, timeout: float | None = None) -> None:
        """Wait for nodes, map vertices to node ids, drop vertices with no live node.

        A deferred graph (a named family without ``num_vertices``) is built on the nodes
        connected once their number is stable. Raises ``ValueError`` if no vertex has a node
        or the live graph is disconnected.
        """
        if self.graph is None:
            nodes = wait_for_nodes(
                grid,
                max(self.min_available_nodes, 1),
                settle_s=SETTLE_S,
                timeout_s=self.node_wait_s,
                what=self.what,
            )
            self.graph = build_graph(self._graph_spec, len(nodes), self._graph_seed)
            self._check_graph_options()
            log(
                INFO,
                "%s: graph %r on the %d connected nodes",
                self.what,
                self._graph_spec,
                len(nodes),
            )
        all_vertices = vertex_list(self.graph)
        want = max(len(all_vertices), self.min_available_nodes)
        wait_for_nodes(grid, want, timeout_s=self.node_wait_s, strict=False, what=self.what)
        qt = self.query_timeout if self.query_timeout is not None else timeout
        self.vmap = map_vertices(
            grid,
            all_vertices,
            vertex_key=self.vertex_key,
            timeout=qt,
            attempts=self.query_attempts,
            what=self.what,
        )
        # nodes that never answered are not re-queried every round (refresh_nodes)
        self.vmap.unmapped_nodes |= set(grid.get_node_ids()) - self.vmap.known_nodes()
        self.missing_vertices = [v for v in all_vertices if v not in self.vmap.node_of]
        live = [v for v in all_vertices if v in self.vmap.node_of]
        if not live:
            raise ValueError(
                f"{self.what}: no node answered with a graph vertex ({self.vertex_key!r} in "
                f"node_config); graph vertices are {all_vertices[:10]}"
            )
        if self.missing_vertices:
            log(
                WARNING,
                "%s: vertices with no live node (excluded from the walk): %s",
                self.what,
                self.missing_vertices,
            )
        G = self.graph.subgraph(live).copy()
        if not nx.is_connected(G):
            comps = [sorted(c) for c in nx.connected_components(G)]
            raise ValueError(
                f"{self.what}: without the vertices that have no node "
                f"({self.missing_vertices}) the graph is disconnected: components {comps}"
            )
        self.live_graph = G
        log(
            INFO,
            "%s: %d vertices mapped to nodes: %s",
            self.what,
            len(live),
            {v: self.vmap.node_of[v] for v in live},
        )
        self._on_setup()

    def _check_graph_options(self) -> None:
        """Subclasses check their graph-dependent options once a deferred graph exists."""

    def refresh_nodes(self, grid: Grid, timeout: float | None) -> None:
        """Query node ids never seen before (restarted / late SuperNodes) and remap vertices
        (in node-id-order mode: give vertices whose node is gone the new node ids)."""
        if self.vmap is None:
            return
        listed = set(grid.get_node_ids())
        new = listed - self.vmap.known_nodes()
        if new and self.vmap.by_node_order:
            moved = assign_new_nodes(self.vmap, self.vertices, listed)
            if moved:
                log(INFO, "%s: vertices %s moved to new nodes (node-id order)", self.what, moved)
        elif new:
            log(INFO, "%s: querying %d new node(s): %s", self.what, len(new), sorted(new))
            discover_vertices(
                grid,
                self.vertices,
                vertex_key=self.vertex_key,
                timeout=timeout,
                node_ids=new,
                vmap=self.vmap,
                what=self.what,
            )

    def offline_vertices(self, grid: Grid) -> list[Any]:
        """Live-graph vertices whose node is not listed by the grid right now (skipped)."""
        if self.vmap is None:
            return []
        listed = set(grid.get_node_ids())
        return [v for v in self.vertices if self.vmap.node_of.get(v) not in listed]

    def _on_setup(self) -> None:  # pragma: no cover - overridden
        pass

    # ----------------------------------------------------------------- Flower API
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation of :meth:`current_arrays` on ``fraction_evaluate`` of the live
        vertices' nodes (default 1.0, as FedAvg; 0 when the app evaluates server-side only)."""
        if self.fraction_evaluate == 0.0 or self.vmap is None:
            return []
        listed = set(grid.get_node_ids())
        node_of = self.vmap.node_of
        # vertex order, not node-id order: after a resume the nodes have new ids
        nodes = [node_of[v] for v in self.vertices if node_of.get(v) in listed]
        record = self.current_arrays() if self.live_graph is not None else arrays
        return self.evaluation.configure(server_round, record, config, nodes)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Weighted mean of the valid evaluation replies' metrics (bad replies dropped)."""
        return self.evaluation.aggregate(replies)

    def _run_round(
        self, grid: Grid, server_round: int, config: ConfigRecord, timeout: float
    ) -> dict[str, float]:
        raise NotImplementedError

    def _init_arrays(self, initial_arrays: ArrayRecord) -> None:
        raise NotImplementedError

    # ----------------------------------------------------------------- lifecycle
    @property
    def completed_rounds(self) -> int:
        """Rounds completed (``self.round``, or the round of a state restored by
        :meth:`load_state_dict` that waits for vertex discovery to be applied)."""
        if self._pending_state is not None:
            return int(self._pending_state["meta"]["round"])
        return self.round

    def prepare(self, grid: Grid, initial_arrays: ArrayRecord, timeout: float) -> None:
        """Adopt ``initial_arrays`` (unless restored), discover vertices, apply a pending state."""
        self._init_arrays(initial_arrays)
        if self.live_graph is None:  # a second start() on the same object keeps the mapping
            self.setup(grid, timeout)
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
            self._pending_state = None

    def run_round(
        self,
        grid: Grid,
        server_round: int,
        train_config: ConfigRecord,
        evaluate_config: ConfigRecord,
        timeout: float,
    ) -> RoundOutcome:
        """Query new nodes, run the strategy's round (:meth:`_run_round`), count it in the
        empty-round guard (before the round-end hook, so the streak is in the checkpoint) and
        evaluate federatedly when ``fraction_evaluate > 0`` (replies taken as they arrive;
        nothing sent, nothing pulled: :func:`~flwr_isoloco.strategies.core.evaluation.evaluation_round`)."""
        self.refresh_nodes(grid, self.query_timeout or timeout)
        self.round_replies = []
        metrics = self._run_round(grid, server_round, train_config, timeout)
        self.round = server_round
        self.history.append({**metrics, "round": server_round})
        stop = self._record_progress(server_round, metrics)
        record = MetricRecord(
            {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        )
        evaluated = None
        if self.fraction_evaluate > 0.0:
            evaluated = evaluation_round(
                self._eval_stream,
                grid,
                self.configure_evaluate(server_round, self.current_arrays(), evaluate_config, grid),
                self.aggregate_evaluate,
                server_round=server_round,
                timeout=timeout,
            )
        return RoundOutcome(self.current_arrays(), record, evaluated, stop)

    def _after_round(self, server_round: int) -> None:
        if self.round_end_fn is not None:
            self.round_end_fn(server_round, self)

    def _used(self, metrics: Mapping[str, float]) -> int:
        """Replies that entered the model this round (RW-LoRA: the hop; gossip: trained)."""
        raise NotImplementedError

    def _record_progress(
        self, server_round: int, metrics: Mapping[str, float]
    ) -> NoProgressError | None:
        """Count the round in the empty-round guard (before the checkpoint, so the streak is in
        the state); the error to raise after the round's callback, if the run must stop."""
        reasons = [
            f"vertex {v!r}: {why}"
            for r, v, why in getattr(self, "failure_log", [])
            if r == server_round
        ][-3:]
        try:
            self.guard.record(server_round, self._used(metrics), reasons)
        except NoProgressError as exc:
            return exc
        return None

    # ----------------------------------------------------------------- state
    def load_state_dict(
        self,
        state: Mapping[str, Any],
        reference: Mapping[str, Any] | None = None,
        optimizer_reference: Mapping[str, Any] | None = None,
    ) -> None:
        """Restore :meth:`state_dict` output. Applied now if the strategy is set up, else at
        the start of :meth:`start` (after vertex discovery).

        Checked here, before anything is kept: the kind, the counters' types and ranges, and
        (:meth:`_check_state_tensors`) that every tensor is finite and has the shape of
        ``reference`` (the model's adapter, name -> tensor) when given, and for RW-LoRA a
        carried optimizer state that of ``optimizer_reference`` (name -> tensor or shape,
        e.g. the client's ``<param>.exp_avg``/``.exp_avg_sq``). A failure is a
        :class:`~flwr_isoloco.checkpoint.CheckpointError` (a ``ValueError``) naming the field
        or tensor.
        """
        from flwr_isoloco.checkpoint.spec import CheckpointError, Field, check_fields

        if not isinstance(state, Mapping) or "tensors" not in state or "meta" not in state:
            raise ValueError(f"{self.what} state must be a dict with 'tensors' and 'meta'")
        tensors, meta = state["tensors"], state["meta"]
        if not isinstance(tensors, Mapping) or not isinstance(meta, Mapping):
            raise CheckpointError(f"{self.what} state: 'tensors' and 'meta' must be dicts")
        if meta.get("kind") != self.what:
            raise ValueError(
                f"state is for {meta.get('kind')!r}, not {self.what!r}: wrong checkpoint?"
            )
        count = Field("int", min=0)
        check_fields(
            dict(meta),
            {
                "round": count,
                "vertices": Field("list"),
                "failures": count,
                "failures_by_vertex": Field("list", items=Field("list", length=2)),
                "failure_log": Field("list", items=Field("list", length=3), optional=True),
                "local_updates": count,
                "bytes_relayed": count,
                "bytes_p2p": count,
                "empty_streak": Field("int", min=0, optional=True),
                "eval_rng": Field("list", length=3, optional=True),
            },
        )
        if "eval_rng" in meta:
            try:
                rng_from_json(meta["eval_rng"])
            except ValueError as exc:
                raise CheckpointError(f"field 'eval_rng': {exc}") from None
        for name, at in (("failures_by_vertex", 1), ("failure_log", 0)):
            for i, entry in enumerate(meta.get(name, [])):
                key = f"{name}[{i}][{at}]"
                check_fields({key: entry[at]}, {key: count})
        self._check_state_tensors(tensors, meta, reference, optimizer_reference)
        if self.live_graph is not None:
            self._apply_state(state)
        else:
            self._pending_state = dict(state)
            self._preload_state(state)

    def _check_state_tensors(
        self,
        tensors: Mapping[str, Any],
        meta: Mapping[str, Any],
        reference: Any,
        optimizer_reference: Any = None,
    ) -> None:
        """Subclasses check their tensors (and their own meta fields) here."""

    def _ledger_meta(self) -> dict[str, Any]:
        """The hop ledger (failures, local updates, bytes) and the evaluation sampler's
        generator as JSON-able checkpoint meta."""
        return {
            "failures": self.failures,
            "failures_by_vertex": [[v, n] for v, n in self.failures_by_vertex.items()],
            "failure_log": [list(x) for x in self.failure_log],
            "local_updates": self.local_updates,
            "bytes_relayed": self.bytes_relayed,
            "bytes_p2p": self.bytes_p2p,
            "eval_rng": self.evaluation.rng_state(),  # a resumed run samples the same nodes
        }

    def _load_ledger(self, meta: Mapping[str, Any]) -> None:
        """Inverse of :meth:`_ledger_meta` (fields already checked by the state spec)."""
        self.failures = int(meta["failures"])
        self.failures_by_vertex = {v: int(n) for v, n in meta["failures_by_vertex"]}
        self.failure_log = [(int(r), v, str(why)) for r, v, why in meta.get("failure_log", [])]
        self.local_updates = int(meta["local_updates"])
        self.bytes_relayed = int(meta["bytes_relayed"])
        self.bytes_p2p = int(meta["bytes_p2p"])
        if "eval_rng" in meta:  # absent in older checkpoints: the seed's generator goes on
            self.evaluation.load_rng_state(meta["eval_rng"])

    def _preload_state(self, state: Mapping[str, Any]) -> None:
        pass

    def _apply_state(self, state: Mapping[str, Any]) -> None:
        raise NotImplementedError
