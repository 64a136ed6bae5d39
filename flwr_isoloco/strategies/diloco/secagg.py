"""Secure aggregation for DiLoCo and IsoLoCo: each round's train half under Flower's SecAgg+.

:func:`use_secagg` makes a built DiLoCo/IsoLoCo run the train half of every round through
Flower 1.42's ``SecAggPlusWorkflow`` (its legacy path: a ``LegacyContext`` whose strategy is the
round's :class:`SecAggRound`, a legacy ``flwr.server.strategy.Strategy``). The strategy's own
``start`` keeps the loop (resume, global round numbers, ``evaluate_fn``, the divergence guard,
the round-end hook); only :meth:`DiLoCo.run_round` hands the train half here. Per round:

    configure_fit:  the strategy's configure_train (theta, its train config) as FitIns
    clients:        delta_i = theta - theta_i, in the NumPyClient layout, through secaggplus_mod
                    (:mod:`flwr_isoloco.clients.secagg`): clipped to +-c, quantised, masked
    aggregate_fit:  SecAgg+'s unmasked aggregate  a = sum_i w_i delta_i / sum_i w_i  (+- step)
                    -> checked -> g = rule([a]) (mean: a; Iso-C of the mean) -> outer step

so the ServerApp never holds a single client's update, only masked vectors and their sum.
Weights: SecAgg+ weights by the reply's ``num_examples``, quantised to ``w_i / max_weight``;
with ``weighting="uniform"`` the clients report 1 and ``max_weight`` is 1, so every weight is
exactly 1 and ``a`` is the plain mean. The quantisation step: each client's entry ``w_i/W x``
is rounded stochastically to a grid of ``2c / Q`` (``c = clipping_range``,
``Q = quantization_range``), so ``|a - mean| < (2c / Q) M / sum_i (w_i / W)`` per entry
(uniform: ``< 2c / Q``, 3.8e-6 at Flower's ``c = 8``, ``Q = 2^22``), provided every
``|delta_i| <= c`` (larger entries are clipped; the clients report how many, metric
``secagg-clipped-entries``) and ``M (Q + 1) < modulus_range`` (no wrap-around).

Still checked: the aggregate (names, shapes, finite, norm) and each reply's weight and local-DP
echo; a failure, or a malformed SecAgg+ reply that makes Flower's workflow raise, is a logged
empty round (model kept), never a crash. The privacy guide (the repository's
``docs/privacy.md``, "Secure aggregation") has the rest.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from logging import WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common import FitIns, FitRes, Parameters, ndarray_to_bytes, parameters_to_ndarrays
from flwr.common.logger import log
from flwr.server import LegacyContext, ServerConfig
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey

from flwr_isoloco.clients.secagg import (
    CLIPPED_METRIC,
    FLOAT_KEYS_KEY,
    KEYS_KEY,
    RANGE_KEY,
    WEIGHTING_KEY,
)
from flwr_isoloco.compression import payload_nbytes
from flwr_isoloco.merging.device import is_out_of_memory
from flwr_isoloco.strategies.core.lifecycle import RoundOutcome
from flwr_isoloco.strategies.core.metrics import metric_record, tensor_norm, train_client_metrics
from flwr_isoloco.strategies.core.replies import MAX_MERGEABLE_NORM, CheckedReply, ReplyReport
from flwr_isoloco.strategies.diloco.composition import refusal
from flwr_isoloco.strategies.diloco.diloco import federated_evaluation
from flwr_isoloco.strategies.diloco.privacy import require_secagg
from flwr_isoloco.strategies.diloco.round_close import RoundClose
from flwr_isoloco.strategies.diloco.secagg_settings import SecAggSettings
from flwr_isoloco.strategies.diloco.setup import buffer_keys

if TYPE_CHECKING:
    from flwr.serverapp import Grid

    from flwr_isoloco.strategies.diloco.diloco import DiLoCo

__all__ = ["CLIPPED_METRIC", "SecAggRound", "SecAggSettings", "SecAggShim", "use_secagg"]


def use_secagg(strategy: DiLoCo, settings: SecAggSettings | None = None, **kw: Any) -> DiLoCo:
    """Run ``strategy``'s train rounds under SecAgg+ (module docstring); returns it.

    ``ValueError`` (:func:`~flwr_isoloco.strategies.diloco.privacy.require_secagg`) when it uses an
    option that needs single replies, or a bad SecAgg+ parameter (``kw``: the fields of
    :class:`SecAggSettings`)."""
    if getattr(strategy, "download", None) is not None:  # the masked sum is taken against theta
        raise ValueError(  # the sentence of composition.SECAGG_DOWNLOAD
            "secagg: not supported with a download codec (download=): SecAgg+ sends every node "
            "the full model and sums the deltas against it, so there is no broadcast model for "
            "a download codec to compress; use download=None with SecAgg+"
        )
    if strategy.rounds.asynchronous:
        why = refusal("asynchronous", "secagg")
        raise ValueError(f"secagg: not supported with asynchronous rounds: {why}")
    require_secagg(strategy)
    settings = settings if settings is not None else SecAggSettings(**kw)
    settings.check()
    try:  # Flower's own checks of shares / threshold
        settings.workflow(strategy.weighting, None)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"secagg: {exc}") from None
    strategy.secagg = SecAggShim(settings)
    return strategy


class _NodeProxy(ClientProxy):
    """A node id for the legacy workflow (it only reads ``node_id``)."""

    def __init__(self, node_id: int) -> None:
        super().__init__(str(node_id))
        self.node_id = node_id

    def _unused(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("SecAggRound's proxies are addresses only")

    get_properties = get_parameters = fit = evaluate = reconnect = _unused


def _record_bytes(content: RecordDict) -> int:
    """Bytes of a message's arrays and of the bytes values of its configs (masked vectors,
    keys, shares travel as config bytes in SecAgg+)."""
    n = sum(payload_nbytes(rec) for rec in content.array_records.values())
    for rec in content.config_records.values():
        for v in rec.values():
            if isinstance(v, bytes):
                n += len(v)
            elif isinstance(v, list):
                n += sum(len(b) for b in v if isinstance(b, bytes))
    return n


class _CountingGrid:
    """The grid, counting the bytes of every SecAgg+ message down and every reply up."""

    def __init__(self, grid: Grid) -> None:
        self._grid, self.down, self.up = grid, 0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None):
        messages = list(messages)
        self.down += sum(_record_bytes(m.content) for m in messages)
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        self.up += sum(_record_bytes(m.content) for m in replies if m.has_content())
        return replies


class SecAggShim:
    """What :func:`use_secagg` attaches to a strategy: runs its train half under SecAgg+."""

    def __init__(self, settings: SecAggSettings) -> None:
        self.settings = settings

    def describe(self) -> str:
        return self.settings.describe()

    def run_round(
        self,
        s: DiLoCo,
        grid: Grid,
        server_round: int,
        train_config: ConfigRecord,
        evaluate_config: ConfigRecord,
        timeout: float,
    ) -> RoundOutcome:
        """SecAgg+ train round, then the strategy's evaluation (as :meth:`DiLoCo.run_round`)."""
        adapter = SecAggRound(s, grid, train_config, self.settings)
        run_id = getattr(getattr(grid, "run", None), "run_id", 0) or 0
        base = Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config={})
        ctx = LegacyContext(base, config=ServerConfig(num_rounds=server_round), strategy=adapter)
        ctx.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
            {WorkflowKey.CURRENT_ROUND: server_round, WorkflowKey.START_TIME: time.time()}
        )
        ctx.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()  # the adapter sends theta
        counting = _CountingGrid(grid)
        t0 = time.perf_counter()
        try:
            self.settings.workflow(s.weighting, timeout)(counting, ctx)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - hostile SecAgg+ replies must not end the run
            if exc is adapter.own_error:  # ours on purpose (NoProgressError, DP budget): raise
                raise
            log(
                WARNING,
                "aggregate_train: SecAgg+ failed in round %d (%s: %s); model kept",
                server_round,
                type(exc).__name__,
                str(exc)[:300],
            )
        new_arrays, train_metrics = adapter.outcome(counting, time.perf_counter() - t0)
        evaluate_metrics = federated_evaluation(s, grid, server_round, evaluate_config, timeout)
        return RoundOutcome(new_arrays, train_metrics, evaluate_metrics)


class SecAggRound(LegacyStrategy):
    """One SecAgg+ train round of strategy ``s``, as the legacy strategy Flower's workflow
    drives: :meth:`configure_fit` sends ``theta`` (FitIns), :meth:`aggregate_fit` takes the
    unmasked aggregate and applies the strategy's merge rule and outer step."""

    def __init__(
        self, s: DiLoCo, grid: Grid, train_config: ConfigRecord, settings: SecAggSettings
    ) -> None:
        self.s, self.grid, self.train_config, self.settings = s, grid, train_config, settings
        self.floats: list[str] = []
        self.round = 0  # the strategy's round once configure_fit ran
        self.own_error: BaseException | None = None  # raised by the strategy, not by Flower
        self._result: tuple[ArrayRecord | None, dict[str, Any]] | None = None

    # --------------------------------------------------------------- unused legacy parts
    def initialize_parameters(self, client_manager: Any) -> Parameters | None:
        return None

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: Any):
        return []

    def aggregate_evaluate(self, server_round: int, results: Any, failures: Any):
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters):
        return None

    # --------------------------------------------------------------- the round
    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: Any
    ) -> list[tuple[ClientProxy, FitIns]]:
        try:
            return self._configure_fit(server_round, client_manager)
        except BaseException as exc:
            self.own_error = exc
            raise

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[Any],
    ) -> tuple[Parameters | None, dict[str, Any]]:
        """Check, merge (the rule of the mean), outer step; never raises on bad input."""
        try:
            self._aggregate_fit(results, failures)
        except BaseException as exc:
            self.own_error = exc
            raise
        return None, {}  # the strategy holds the model; the workflow's copy is not used

    def _configure_fit(
        self, server_round: int, client_manager: Any
    ) -> list[tuple[ClientProxy, FitIns]]:
        """The strategy's train messages as FitIns (one shared ``theta``, its names in the
        config); counts the round as the strategy's, as :meth:`DiLoCo.run_round` does."""
        s = self.s
        msgs = list(
            s.configure_train(server_round, s.current_arrays(), self.train_config, self.grid)
        )
        s.server_round += 1
        self.round = s.server_round
        assert s.theta is not None
        self.floats = [k for k, t in s.theta.items() if t.is_floating_point()]
        if not msgs:
            return []
        rec = msgs[0].content.array_records[s.arrayrecord_key]
        config = dict(msgs[0].content.config_records[s.configrecord_key])
        config[KEYS_KEY] = "\n".join(rec.keys())
        config[FLOAT_KEYS_KEY] = "\n".join(self.floats)
        config[WEIGHTING_KEY] = s.weighting
        config[RANGE_KEY] = float(self.settings.clipping_range)
        params = Parameters([ndarray_to_bytes(a.numpy()) for a in rec.values()], "numpy.ndarray")
        fitins = FitIns(params, config)
        proxies = [_NodeProxy(m.metadata.dst_node_id) for m in msgs]
        for p in proxies:  # so that Flower's log line counts them ("out of M")
            client_manager.register(p)
        return [(p, fitins) for p in proxies]

    def _node(self, proxy: ClientProxy) -> int:
        return int(proxy.node_id)

    def _aggregate(self, parameters: Parameters) -> dict[str, torch.Tensor] | str:
        """The aggregate as the strategy's float tensors, or why it is refused."""
        s = self.s
        assert s.theta is not None
        arrays = parameters_to_ndarrays(parameters)
        if len(arrays) != len(self.floats):
            return f"{len(arrays)} arrays, the model has {len(self.floats)} float tensors"
        out = {}
        for k, a in zip(self.floats, arrays, strict=True):
            if tuple(a.shape) != tuple(s.theta[k].shape):
                return (
                    f"tensor {k!r} has shape {tuple(a.shape)}, expected {tuple(s.theta[k].shape)}"
                )
            if not np.issubdtype(a.dtype, np.floating) or not np.isfinite(a).all():
                return f"tensor {k!r} is not finite floating-point"
            out[k] = torch.from_numpy(np.asarray(a, dtype=np.float32)).to(s.theta[k].dtype)
        norm = tensor_norm(out)
        if not norm < MAX_MERGEABLE_NORM:
            return f"aggregate norm {norm:.3g} exceeds {MAX_MERGEABLE_NORM:g}"
        return out

    def _reply_problem(self, nid: int, fitres: FitRes) -> str | None:
        """Why reply ``nid`` spoils the aggregate (its weight, its DP echo), or None."""
        s, w = self.s, fitres.num_examples
        cap = self.settings.weight_cap(s.weighting)
        if s.weighting == "uniform" and w != 1:
            return f"weight {w!r} under uniform weighting (must be 1): the mean is mis-weighted"
        if isinstance(w, bool) or not isinstance(w, int) or not 0 < w <= cap:
            return (
                f"weight {w!r} outside (0, max_weight={cap:g}]: SecAgg+ clipped or mis-weighted it"
            )
        return s.dp.reply_problem(RecordDict({"config": ConfigRecord(_scalars(fitres.metrics))}))

    def _aggregate_fit(
        self, results: list[tuple[ClientProxy, FitRes]], failures: list[Any]
    ) -> None:
        s, report = self.s, ReplyReport()
        # Flower lists a node lost in the masked-vector stage twice: count by what came back,
        # and name each node sent the round whose masked vector did not (a straggler, a death)
        back = {self._node(proxy) for proxy, _ in results}
        lost = [m.dst_node_id for m in s.book.train_ledger.sent() if m.dst_node_id not in back]
        s.train_validator.count_missing(lost, report)
        for f in dict.fromkeys(str(f).split("\n")[0][:300] for f in failures):
            log(WARNING, "aggregate_train (round %d): SecAgg+ lost a node: %s", self.round, f)
        replies, problems = [], []
        for proxy, fitres in results:
            nid = self._node(proxy)
            why = self._reply_problem(nid, fitres)
            if why is not None:
                problems.append((nid, why))
            metrics = {k: float(x) for k, x in _numbers(fitres.metrics).items()}
            clipped = int(metrics.get(CLIPPED_METRIC, 0))
            if clipped:
                log(
                    WARNING,
                    "aggregate_train: node %d: %d delta entries beyond +-%g clipped by SecAgg+",
                    nid,
                    clipped,
                    self.settings.clipping_range,
                )
            weight = float(fitres.num_examples) if s.weighting == "examples" else 1.0
            # what an app's train_metrics_aggr_fn reads, as in a plain round's reply
            content = RecordDict({"metrics": MetricRecord({**metrics, s.weighted_by_key: weight})})
            replies.append(CheckedReply(nid, weight, metrics, "delta", content))
        agg = self._aggregate(results[0][1].parameters) if results else None
        if isinstance(agg, str):
            problems.append((-1, f"the aggregate: {agg}"))
        close, extra, new_arrays = RoundClose(s, self.round, report), {}, None
        if problems or agg is None:
            for nid, why in problems:
                log(
                    WARNING,
                    "aggregate_train: SecAgg+ aggregate of round %d dropped (node %d: "
                    "%s); model kept",
                    self.round,
                    nid,
                    why,
                )
            close.drop(replies, "the round's SecAgg+ aggregate was dropped")
            replies = []
        else:
            new_arrays, replies, extra = self._step(close, agg, replies)
        metrics = {
            # SecAgg+ merges with weights w_i (no further bound)
            **train_client_metrics(
                replies,
                [r.weight for r in replies],
                s.weighted_by_key,
                s.train_metrics_aggr_fn,
                exclude=[CLIPPED_METRIC],
            ),
            **extra,
            CLIPPED_METRIC: sum(int(r.metrics.get(CLIPPED_METRIC, 0)) for r in replies),
        }
        self._result = (new_arrays, close.close(replies, metrics))

    def _step(
        self, close: RoundClose, agg: Mapping[str, torch.Tensor], replies: list[CheckedReply]
    ) -> tuple[ArrayRecord | None, list[CheckedReply], dict[str, Any]]:
        """``g = rule([agg])``, then the round's outer step (:meth:`RoundClose.step`): the new
        model (None: kept), the replies used and the extra metrics; a failure drops the round's
        replies (named)."""
        s = self.s
        assert s.theta is not None
        t0 = time.perf_counter()
        try:
            aggregate = [_Aggregate(dict(agg))]
            g = s.merger.merge(
                s.theta, aggregate, [], lambda r: 1.0, self.round, buffers=buffer_keys(s)
            )
        except (ValueError, RuntimeError) as exc:
            if is_out_of_memory(exc):  # the server's fault, not the replies': fail loudly
                raise
            close.drop(replies, f"merge failed, model kept: {exc}")
            return None, [], {}
        if g is None:
            return None, [], {}
        bound = self.settings.bound([r.weight for r in replies], s.weighting)
        new_arrays, used, extra = close.step(g, replies)
        extra.update({"secagg-bound": bound, "aggregation-time-s": time.perf_counter() - t0})
        return new_arrays, used, extra

    def outcome(self, grid: _CountingGrid, wall_s: float) -> tuple[ArrayRecord | None, Any]:
        """The round's new model (None: kept) and train metrics; a workflow that halted before
        the aggregate (too few nodes) is an empty round."""
        s = self.s
        if self._result is None:
            if self.round:  # sent, but SecAgg+ halted or failed: no aggregate reached us
                log(WARNING, "aggregate_train: SecAgg+ halted in round %d; model kept", self.round)
                close = RoundClose(s, self.round, ReplyReport(missing=s.book.train_ledger.count()))
                halted = ["SecAgg+ halted (too few or bad replies)"]
                self._result = (None, close.close([], {}, empty_reasons=halted))
            else:
                return None, None
        arrays, metrics = self._result
        metrics = {**metrics, "bytes-up": grid.up, "bytes-down": grid.down, "secagg-time-s": wall_s}
        return arrays, metric_record(metrics)


@dataclass
class _Aggregate:
    """SecAgg+'s aggregate as the one "reply" the strategy's merge rule sees."""

    delta: dict[str, torch.Tensor]
    node_id: int = -1

    def update(self, theta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.delta

    def release(self) -> None:
        pass


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: v
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def _scalars(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if isinstance(v, (int, float, str, bool))}
