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
norm) leaves the last good token in place, the failure is counted, and the walk re-routes: it
redraws from the current vertex's row with the failed vertices removed (renormalised), up to
``max_reroutes`` times per round. This biases the walk away from unreliable vertices; see
docs/rwlora.md.

Bytes: ``bytes-relayed`` counts what crossed the wire through the server (instruction down +
reply up, also for failed attempts), ``bytes-p2p`` what a peer-to-peer deployment would send
(one token per hop to a *different* vertex, including failed attempts; a lazy self-loop stays on
the node and costs 0; the first placement costs one token).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import networkx as nx
import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..graphs import (
    RandomWalk,
    build_graph,
    spectral_gap,
    stationary_distribution,
    total_variation,
    transition_matrix,
    vertex_list,
)
from .common import CheckedReply, ReplyValidator, SentLedger

__all__ = ["RWLoRA", "VertexMap", "discover_vertices", "record_nbytes"]

QUERY_VERTEX_KEY = "vertex-key"


# ----------------------------------------------------------------------------- helpers


def record_nbytes(*records: ArrayRecord | None) -> int:
    """Serialised payload bytes of ArrayRecords (what goes on the wire, headers aside)."""
    return sum(len(a.data) for r in records if r is not None for a in r.values())


def _vertex_from_value(value: Any, vertices: Iterable[Any]) -> Any:
    verts = set(vertices)
    if value in verts and not isinstance(value, bool):
        return value
    if isinstance(value, (str, float)):
        try:
            as_int = int(value)
            if as_int in verts and float(value) == as_int:
                return as_int
        except ValueError:
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


def _wait_for_nodes(grid: Grid, want: int, wait_s: float, what: str) -> None:
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


def _tensors_of(rec: ArrayRecord | None) -> dict[str, torch.Tensor]:
    if rec is None:
        return {}
    return {k: torch.from_numpy(np.array(a.numpy(), copy=True)) for k, a in rec.items()}


def _record_of(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


def _config_to_json(cfg: ConfigRecord | None) -> dict[str, Any]:
    if cfg is None:
        return {}
    out = {}
    for k, v in cfg.items():
        if isinstance(v, bytes):
            out[k] = {"__bytes__": v.hex()}
        else:
            out[k] = v
    return out


def _config_from_json(d: Mapping[str, Any]) -> ConfigRecord:
    out = {}
    for k, v in d.items():
        out[k] = bytes.fromhex(v["__bytes__"]) if isinstance(v, Mapping) else v
    return ConfigRecord(out)


# ----------------------------------------------------------------------------- base


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
    ``dtype_policy`` (``cast`` | ``reject``), ``max_update_norm``, ``round_end_fn``.
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
        _wait_for_nodes(grid, len(all_vertices), self.node_wait_s, self.what)
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
            self.history.append({"round": server_round, **metrics})
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
        result.arrays = self.current_arrays()
        log(INFO, "%s finished in %.2fs", self.__class__.__name__, time.time() - t0)
        return result

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
    transition : ``"simple"`` | ``"metropolis"``
        Transition matrix (:func:`flwr_isoloco.graphs.transition_matrix`).
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
        transition: str = "simple",
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
        **kwargs: Any,
    ) -> None:
        super().__init__(graph, num_vertices=num_vertices, local_steps=local_steps, **kwargs)
        self.transition = transition
        self.target = target
        self.lazy = bool(lazy)
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
        self.pi = stationary_distribution(self.P)
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
        """Draw the next vertex (excluding vertices that failed since the last good hop) and
        address the token to its node. Empty if no candidate is left."""
        if self.walk is None:
            self._init_arrays(arrays)
            self.setup(grid)
        if self.token is None:
            self._init_arrays(arrays)
        offline = self.offline_vertices(grid)
        v = self.walk.draw(exclude=set(self.excluded) | set(offline))
        if v is None and self.walk.position is None and self.start_vertex is not None:
            log(
                WARNING,
                "%s: start vertex %r unavailable; first vertex drawn from pi",
                self.what,
                self.start_vertex,
            )
            self.walk.initial = self.pi.copy()
            v = self.walk.draw(exclude=set(self.excluded) | set(offline))
        self._pending_vertex, self._pending_round = v, server_round
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
            update = reply.update(expected)
            norm = math.sqrt(sum(float(u.double().pow(2).sum()) for u in update.values()))
            recent = self.update_norms[-self.norm_window :]
            if (
                self.max_norm_ratio is not None
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
        self.trajectory.append(v)
        self._visits[v] = self._visits.get(v, 0) + 1
        self.excluded = []
        self.update_norms.append(norm)
        self.update_norms = self.update_norms[-self.norm_window :]
        steps = reply.metrics.get("local-steps", self.local_steps)
        self.local_updates += int(steps) if steps >= 0 else self.local_steps
        client = {
            k: float(x) for k, x in reply.metrics.items() if k not in ("local-steps", "walk-vertex")
        }
        return True, {"hop-ok": 1, "update-norm": norm, **client}

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
        }

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
