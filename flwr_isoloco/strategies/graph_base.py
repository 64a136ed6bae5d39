"""The base class of the graph strategies (RW-LoRA, gossip): graph, vertex discovery, the round
loop with resume, server-side evaluation, a per-round callback and the empty-round guard."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from logging import ERROR, INFO, WARNING
from typing import Any

import networkx as nx
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..graphs import build_graph, vertex_list
from .common import EmptyRoundGuard, NoProgressError, ReplyValidator
from .vertices import VertexMap, discover_vertices, wait_for_nodes

__all__ = ["GraphStrategy"]


class GraphStrategy(Strategy):
    """Shared plumbing of the graph strategies (RW-LoRA, gossip): graph, vertex discovery,
    the round loop with resume (``start`` runs rounds ``self.round + 1 .. num_rounds``),
    server-side evaluation and a per-round callback (for checkpoints).

    Keyword arguments shared by both: ``num_vertices`` / ``graph_seed`` (for
    :func:`~flwr_isoloco.graphs.build_graph`), ``vertex_key`` (node_config key the clients
    answer, default ``partition-id``), ``local_steps`` (K), ``node_wait_s`` (how long to wait
    for one node per vertex before the QUERY round, default 60 s), ``query_timeout`` (default:
    the ``timeout`` given to ``start``), ``query_attempts`` (QUERY retries for silent nodes,
    default 3; nodes that never answer are left out), ``arrayrecord_key`` /
    ``configrecord_key`` / ``weighted_by_key`` (as FedAvg), ``require_weight`` (default False),
    ``dtype_policy`` (``cast`` | ``reject``), ``max_update_norm``, ``round_end_fn``,
    ``max_empty_rounds`` (default 3: that many consecutive rounds in which no reply was used
    stop :meth:`start` with :class:`~flwr_isoloco.strategies.common.NoProgressError`; 0 = off).
    """

    what = "graph-strategy"

    def __init__(
        self,
        graph: str | nx.Graph,
        *,
        num_vertices: int | None = None,
        graph_seed: int | None = 0,
        vertex_key: str = "partition-id",
        local_steps: int = 1,
        node_wait_s: float = 60.0,
        query_timeout: float | None = None,
        query_attempts: int = 3,
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        weighted_by_key: str = "num-examples",
        require_weight: bool = False,
        dtype_policy: str = "cast",
        max_update_norm: float | None = None,
        round_end_fn: Callable[[int, GraphStrategy], None] | None = None,
        max_empty_rounds: int = 3,
    ) -> None:
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(f"local_steps must be an int >= 1, got {local_steps!r}")
        if not vertex_key or not isinstance(vertex_key, str):
            raise ValueError(f"vertex_key must be a non-empty str, got {vertex_key!r}")
        self.graph = build_graph(graph, n=num_vertices, seed=graph_seed)
        self.vertex_key = vertex_key
        self.local_steps = local_steps
        self.node_wait_s = float(node_wait_s)
        self.query_timeout = query_timeout
        if (
            isinstance(query_attempts, bool)
            or not isinstance(query_attempts, int)
            or query_attempts < 1
        ):
            raise ValueError(f"query_attempts must be an int >= 1, got {query_attempts!r}")
        self.query_attempts = query_attempts
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.weighted_by_key = weighted_by_key
        self.round_end_fn = round_end_fn
        self.guard = EmptyRoundGuard(max_empty_rounds, self.what)
        self.validator = ReplyValidator(
            arrayrecord_key=arrayrecord_key,
            weighted_by_key=weighted_by_key,
            require_weight=require_weight,
            dtype_policy=dtype_policy,
            max_update_norm=max_update_norm,
            what=self.what,
        )
        self.vmap: VertexMap | None = None
        self.live_graph: nx.Graph | None = None
        self.missing_vertices: list[Any] = []
        self.round = 0  # rounds completed
        self.history: list[dict[str, float]] = []
        self._pending_state: dict[str, Any] | None = None

    # ----------------------------------------------------------------- vertices
    @property
    def vertices(self) -> list[Any]:
        """Live vertices (after discovery), else all graph vertices."""
        return vertex_list(self.live_graph if self.live_graph is not None else self.graph)

    def setup(self, grid: Grid, timeout: float | None = None) -> None:
        """Wait for nodes, map vertices to node ids, drop vertices with no live node.

        Raises ``ValueError`` if no vertex has a node or the live graph is disconnected.
        """
        all_vertices = vertex_list(self.graph)
        wait_for_nodes(grid, len(all_vertices), self.node_wait_s, self.what)
        qt = self.query_timeout if self.query_timeout is not None else timeout
        self.vmap = discover_vertices(
            grid, all_vertices, vertex_key=self.vertex_key, timeout=qt, what=self.what
        )
        for attempt in range(2, self.query_attempts + 1):
            silent = set(grid.get_node_ids()) - self.vmap.known_nodes()
            if not silent or len(self.vmap.node_of) == len(all_vertices):
                break
            log(
                INFO,
                "%s: vertex query attempt %d for %d silent node(s)",
                self.what,
                attempt,
                len(silent),
            )
            discover_vertices(
                grid,
                all_vertices,
                vertex_key=self.vertex_key,
                timeout=qt,
                node_ids=silent,
                vmap=self.vmap,
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

    def refresh_nodes(self, grid: Grid, timeout: float | None) -> None:
        """Query node ids never seen before (restarted / late SuperNodes) and remap vertices."""
        if self.vmap is None:
            return
        new = set(grid.get_node_ids()) - self.vmap.known_nodes()
        if new:
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
        """No federated evaluation: the app evaluates the token server-side (evaluate_fn)."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> None:
        return None

    def _run_round(
        self, grid: Grid, server_round: int, config: ConfigRecord, timeout: float
    ) -> dict[str, float]:
        raise NotImplementedError

    def current_arrays(self) -> ArrayRecord:
        raise NotImplementedError

    def _init_arrays(self, initial_arrays: ArrayRecord) -> None:
        raise NotImplementedError

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run rounds ``self.round + 1 .. num_rounds`` (all of them for a fresh strategy; the
        rest after ``load_state_dict``). ``timeout`` bounds each hop's wait for its reply."""
        log(INFO, "Starting %s strategy:", self.__class__.__name__)
        self.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        result = Result()
        t0 = time.time()
        self._init_arrays(initial_arrays)
        if self.live_graph is None:  # a second start() on the same object keeps the mapping
            self.setup(grid, timeout)
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
            self._pending_state = None
        if evaluate_fn is not None and self.round == 0:
            res = evaluate_fn(0, self.current_arrays())
            log(INFO, "Initial global evaluation results: %s", res)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        for server_round in range(self.round + 1, num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
            self.refresh_nodes(grid, self.query_timeout or timeout)
            metrics = self._run_round(grid, server_round, ConfigRecord(dict(train_config)), timeout)
            self.round = server_round
            self.history.append({**metrics, "round": server_round})
            stop = self._record_progress(server_round, metrics)  # raised after the callbacks
            record = MetricRecord(
                {
                    k: v
                    for k, v in metrics.items()
                    if isinstance(v, (int, float)) and math.isfinite(v)
                }
            )
            result.train_metrics_clientapp[server_round] = record
            log(INFO, "\t└──> %s metrics: %s", self.what, dict(record))
            if evaluate_fn is not None:
                res = evaluate_fn(server_round, self.current_arrays())
                log(INFO, "\t└──> server-side evaluation: %s", res)
                if res is not None:
                    result.evaluate_metrics_serverapp[server_round] = res
            if self.round_end_fn is not None:
                self.round_end_fn(server_round, self)
            if stop is not None:
                log(ERROR, "%s", stop)
                raise stop
        result.arrays = self.current_arrays()
        log(INFO, "%s finished in %.2fs", self.__class__.__name__, time.time() - t0)
        return result

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
        from flwr_isoloco.checkpoint_spec import CheckpointError, Field, check_fields

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
            },
        )
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

    def _preload_state(self, state: Mapping[str, Any]) -> None:
        pass

    def _apply_state(self, state: Mapping[str, Any]) -> None:
        raise NotImplementedError
