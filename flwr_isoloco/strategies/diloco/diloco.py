"""DiLoCo and IsoLoCo as Flower Message-API strategies.

Each round the server sends the global model ``theta`` to the sampled nodes; node ``i`` trains
and replies FedAvg-style (its weights ``theta_i`` under ``arrays``, ``num-examples`` in a
MetricRecord), or its delta (ConfigRecord ``payload="delta"``, or ``ReplyChecks(payload="delta")``).
The server forms the pseudo-gradients ``delta_i = theta - theta_i``, merges them

    g = merge(delta_1..delta_M; w),   w_i = num-examples_i  (or 1 with ``ReplyChecks(weighting="uniform")``)

and applies the outer optimiser (``torch.optim.SGD`` convention, dampening 0)::

    b <- mu*b + g;  u = g + mu*b (Nesterov) | b (heavy-ball) | g (mu = 0)
    u <- iso_c(u)   (only with orthogonalize="update")
    theta <- theta - lr*u

``DiLoCo(merge="mean", outer_lr=1.0, outer_momentum=0.0)`` is FedAvg. Bad replies are dropped
with a logged reason (:mod:`~flwr_isoloco.strategies.core.replies`); replies are merged in
content-digest order (not node-id order); node sampling and DARE masks come from ``seed``. Round merge: :mod:`flwr_isoloco.merging.fold`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from types import MappingProxyType
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_isoloco.compression import payload_nbytes
from flwr_isoloco.merging import resolve_device
from flwr_isoloco.merging.buffers import merged_buffers
from flwr_isoloco.settings_tools import renamed_fields
from flwr_isoloco.strategies.core.evaluation import aggregate_metrics, evaluation_round
from flwr_isoloco.strategies.core.guard import EmptyRoundGuard
from flwr_isoloco.strategies.core.lifecycle import (
    ResumableStrategy,
    RoundOutcome,
    set_divergence_guard,
)
from flwr_isoloco.strategies.core.nodes import DEFAULT_NODE_WAIT_S, nodes_for_round
from flwr_isoloco.strategies.core.stream import ReplyStream
from flwr_isoloco.strategies.diloco import asynchronous_setup as asyn
from flwr_isoloco.strategies.diloco import downloads
from flwr_isoloco.strategies.diloco.asynchronous_tasks import asked_steps
from flwr_isoloco.strategies.diloco.config import (
    DILOCO_RUN_CONFIG,
    ISOLOCO_RUN_CONFIG,
    check_arguments,
)
from flwr_isoloco.strategies.diloco.privacy import StrategyDP
from flwr_isoloco.strategies.diloco.round_close import RoundBook
from flwr_isoloco.strategies.diloco.sections import FromRunConfig
from flwr_isoloco.strategies.diloco.settings import (
    Codec,
    Divergence,
    DPSettings,
    MergeSettings,
    Records,
    ReplyChecks,
    Robust,
    Rounds,
    as_codec,
    as_robust,
)
from flwr_isoloco.strategies.diloco.setup import (
    MOVED_ARGUMENTS,
    RECORD_FIELDS,
    SettingsViews,
    buffer_keys,
    check_codecs,
    codec_request,
    outer_optimizer,
    setup_merge,
    validators,
)
from flwr_isoloco.strategies.diloco.state import DiLoCoState, log_summary
from flwr_isoloco.strategies.diloco.train_round import TrainRound

__all__ = [
    "DILOCO_RUN_CONFIG",
    "ISOLOCO_RUN_CONFIG",
    "DiLoCo",
    "draw",
    "federated_evaluation",
    "record_of",
    "sample_nodes",
]


@renamed_fields(**MOVED_ARGUMENTS)
class DiLoCo(FromRunConfig, SettingsViews, DiLoCoState, ResumableStrategy):
    """DiLoCo: merge the nodes' pseudo-gradients, then an outer SGD/Nesterov step.

    Parameters
    ----------
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes,
    min_available_nodes :
        As in ``flwr.serverapp.strategy.FedAvg``.
    records : Records
        FedAvg's record keys and metric aggregations.
    merge : str | MergeRule
        The rule for ``g``: a name in ``flwr_isoloco.merging.MERGE_RULES`` or a MergeRule.
    outer_lr, outer_momentum, nesterov :
        The outer optimiser's ``lr``, ``mu`` and Nesterov switch (ignored when ``mu = 0``).
    seed : int
        Seed for node sampling and DARE masks.
    merge_settings : MergeSettings
        The rule's options, ``orthogonalize``, the merge's device and the buffers.
    checks : ReplyChecks
        Weighting, default payload, norm and weight bounds, dtype policy of the replies.
    rounds : Rounds
        Quorum and grace window; empty rounds before a stop; asynchronous rounds.
    upload : Codec | str | None
        The workers' delta codec: int8, fp8, int4, topk, sparseloco (``mods=[upload_mod]``).
    download : Codec | str | None
        The model codec down (``mods=[download_mod]``); ``"exact"``: nodes redo the step.
    divergence : Divergence
        What a round that makes the ``evaluate_fn`` loss blow up does (``"warn"`` by default).
    robust : Robust | str | None
        Robust aggregation in place of the mean (``Median()``, ``Krum(f)``, ...).
    privacy : CentralDP | LocalDP | None
        Differential privacy (clip to ``C``, Gaussian noise, epsilon accounting).

    Settings classes document their fields. FedAvg: ``merge="mean", outer_lr=1, outer_momentum=0``.
    """

    def __init__(
        self,
        *,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        records: Records = Records(),  # noqa: B008 (frozen)
        merge: Any = "mean",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        seed: int = 0,
        merge_settings: MergeSettings = MergeSettings(),  # noqa: B008 (frozen)
        checks: ReplyChecks = ReplyChecks(),  # noqa: B008 (frozen)
        rounds: Rounds = Rounds(),  # noqa: B008 (frozen)
        upload: Codec | str | None = None,
        download: Codec | str | None = None,
        divergence: Divergence = Divergence(),  # noqa: B008 (frozen)
        robust: Robust | str | None = None,
        privacy: DPSettings | None = None,
    ) -> None:
        args = dict(locals())  # every argument by name, for the checks below
        check_arguments(**args)  # fractions, node counts, seed, settings types
        m = merge_settings
        self.checks, self.rounds, self.divergence = checks, rounds, divergence
        self.upload, self.download, self.privacy = as_codec(upload), as_codec(download), privacy
        check_codecs(self.upload, self.download)  # an option that does nothing that way
        self.merge_device = resolve_device(m.device)  # ValueError: e.g. "cuda" without a GPU
        d = divergence
        set_divergence_guard(self, d.on_divergence, d.factor, d.key, d.collapse_factor)
        self.secagg: Any = None  # or the SecAgg+ shim that secagg.use_secagg sets
        self.book = RoundBook(EmptyRoundGuard(rounds.max_empty_rounds, "aggregate_train"))
        setup_merge(self, merge, m.options, m.orthogonalize, seed, as_robust(robust))
        self.buffers = m.buffers  # float tensors the outer step does not own
        self.fraction_train = float(fraction_train)
        self.fraction_evaluate = float(fraction_evaluate)
        self.min_train_nodes = 0 if fraction_train == 0 else min_train_nodes
        self.min_evaluate_nodes = 0 if fraction_evaluate == 0 else min_evaluate_nodes
        self.min_available_nodes, self.seed, self.orthogonalize = (
            min_available_nodes,
            seed,
            m.orthogonalize,
        )
        self.merge_settings, self.records = m, records
        for name in RECORD_FIELDS:  # weighted_by_key, the record keys, the metric aggregations
            setattr(self, name, getattr(records, name))
        self.outer = outer_optimizer(outer_lr, outer_momentum, nesterov)
        self.train_validator, self.eval_validator = validators(self, checks)
        self._reset_bookkeeping(seed)
        self.dp = StrategyDP(privacy)
        self.dp.check_strategy(self)  # refuses rules / options DP cannot bound; weights uniform
        downloads.setup_downloads(self, self.arrayrecord_key)  # broadcast B, codec, refusals
        ops = asyn.StrategyOps(sample_nodes, draw, federated_evaluation, record_of)
        self.async_rounds = asyn.asynchronous_rounds(self, rounds, ops)  # None: synchronous

    def _reset_bookkeeping(self, seed: int) -> None:
        """No model, no round aggregated yet; sampling from ``seed``; empty ledgers, streams."""
        self.book = RoundBook(self.book.guard)  # empty ledgers; the guard's limit stays
        self._rng = random.Random(seed)
        self.theta = None  # fp32 master copy (a property: see _model_record)
        self._dtypes: dict[str, torch.dtype] = {}
        self.server_round = 0  # rounds aggregated so far (continues across resume)
        self.weight_reference: float | None = None  # median weight of the last used round
        self._train_stream = ReplyStream("aggregate_train")
        self._eval_stream = ReplyStream("aggregate_evaluate")

    # ------------------------------------------------------------------ model bookkeeping
    def _adopt(self, arrays: ArrayRecord) -> None:
        sd = arrays.to_torch_state_dict()
        self._dtypes = {k: v.dtype for k, v in sd.items()}
        self.theta = {
            k: (v.detach().float().clone() if v.is_floating_point() else v.detach().clone())
            for k, v in sd.items()
        }

    def __setattr__(self, name: str, value: Any) -> None:
        """A new ``theta`` (fp32 master copy, never changed in place) drops the old's record."""
        if name == "theta":
            self.__dict__["_record"] = None
        super().__setattr__(name, value)

    def _model_record(self) -> ArrayRecord:
        """``theta`` in the model's dtypes, built once per ``theta``: the record sent, the
        round's result, the evaluated and checkpointed model are then one copy, not one each."""
        assert self.theta is not None
        cached = self.__dict__.get("_record")
        if cached is not None and cached[0] is self._dtypes:  # dtypes: replaced, never changed
            return cached[1]
        record = record_of(self, self.theta)
        self.__dict__["_record"] = (self._dtypes, record)
        return record

    @property
    def completed_rounds(self) -> int:
        """Rounds aggregated so far (``server_round``; continues across a resume)."""
        return self.server_round

    @property
    def dtypes(self) -> Mapping[str, torch.dtype]:
        """The model's dtype per key (read-only); ``theta`` is fp32 and is sent in these."""
        return MappingProxyType(self._dtypes)

    def current_arrays(self) -> ArrayRecord:
        """``theta`` in the model's own dtypes."""
        return self._model_record()

    def prepare(self, grid: Grid, initial_arrays: ArrayRecord, timeout: float) -> None:
        """Adopt ``initial_arrays`` (a restored strategy keeps its ``theta``, same keys)."""
        self._round_timeout = timeout
        if self.theta is None:
            self._adopt(initial_arrays)
        elif set(self.theta) != set(initial_arrays.keys()):
            raise ValueError(
                "restored strategy state does not match initial_arrays: keys differ "
                f"(e.g. {sorted(set(self.theta) ^ set(initial_arrays.keys()))[:3]})"
            )

    # ------------------------------------------------------------------ Strategy API
    def summary(self) -> None:
        """Log the configuration, Flower-style."""
        log_summary(self)
        log(INFO, "\t└──> Differential privacy: %s", self.dp.describe())
        if self.secagg is not None:
            log(INFO, "\t└──> Secure aggregation: %s", self.secagg.describe())

    def _messages(
        self, arrays: ArrayRecord, config: ConfigRecord, nodes: list[int], mtype: str
    ) -> list[Message]:
        if self.broadcast is not None:  # per node: the update, nothing or the full B
            msgs, self.book.bytes_down = downloads.broadcast_messages(self, config, nodes, mtype)
            return msgs
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        self.book.bytes_down = payload_nbytes(arrays) * len(nodes)
        return [Message(content=record, message_type=mtype, dst_node_id=n) for n in nodes]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send ``theta`` to the sampled nodes; ``server-round`` counts across resumes."""
        if self.fraction_train == 0.0:
            return []
        if self.theta is None:
            self._adopt(arrays)
        self.dp.before_round(self.server_round + 1)  # PrivacyBudgetExhausted before sending
        nodes = sample_nodes(self, grid, self.fraction_train, self.min_train_nodes)
        log(INFO, "configure_train: sampled %d nodes", len(nodes))
        config["server-round"] = self.server_round + 1
        for k, v in {**codec_request(self.upload), **self.dp.request()}.items():
            config[k] = v
        self.train_validator.asked_steps = asked_steps(config)  # inner-steps <= it
        # a download codec's B: advanced towards theta here or by the evaluation before
        downloads.follow_theta(self.broadcast, self.theta, self.dtypes, self.server_round)
        record = self._model_record() if self.broadcast is None else ArrayRecord()
        msgs = self._messages(record, config, nodes, MessageType.TRAIN)
        return self.book.train_ledger.remember(msgs)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send ``theta`` (with a download codec: ``B`` advanced towards it) for evaluation."""
        if self.fraction_evaluate == 0.0:
            return []
        if self.theta is None:
            self._adopt(arrays)
        a, f, n = self.async_rounds, self.fraction_evaluate, self.min_evaluate_nodes
        nodes = a.evaluation_nodes(self) if a else sample_nodes(self, grid, f, n)  # async: idle
        config["server-round"] = self.server_round
        downloads.follow_theta(self.broadcast, self.theta, self.dtypes, self.server_round)
        saved = self.book.bytes_down  # bytes-down of the train metrics: the train messages
        record = self._model_record() if self.broadcast is None else ArrayRecord()
        msgs = self._messages(record, config, nodes, MessageType.EVALUATE)
        self.eval_bytes_down, self.book.bytes_down = self.book.bytes_down, saved
        return self.book.eval_ledger.remember(msgs)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate, bound the weights, merge, step; a bad reply is dropped, never the round."""
        self.server_round += 1
        if self.theta is None:
            log(WARNING, "aggregate_train: no global model yet (configure_train not called)")
            return None, None
        train = TrainRound(self, self.server_round)
        take = downloads.TrainReplies(self, self.book.train_ledger, train.take)  # codec use counted
        try:
            for msg in replies:
                take(msg)
            take.close(self.server_round)
            return train.finish()
        finally:
            train.close()

    def run_round(
        self,
        grid: Grid,
        server_round: int,
        train_config: ConfigRecord,
        evaluate_config: ConfigRecord,
        timeout: float,
    ) -> RoundOutcome:
        """Train then evaluate, each train reply folded into the merge as it arrives."""
        if (a := self.async_rounds) is not None:  # one outer step (.asynchronous.AsyncRounds)
            return a.run_round(self, grid, server_round, train_config, timeout, evaluate_config)
        if self.secagg is not None:  # the train half under SecAgg+ (strategies/diloco/secagg.py)
            return self.secagg.run_round(
                self, grid, server_round, train_config, evaluate_config, timeout
            )
        arrays = self.current_arrays()
        messages = list(self.configure_train(server_round, arrays, train_config, grid))
        del arrays
        self.server_round += 1
        train = TrainRound(self, self.server_round)
        take = downloads.TrainReplies(self, self.book.train_ledger, train.take, train_config)
        try:
            wait = self._train_stream.run(
                grid,
                messages,
                take,  # a node that lost its copy of B gets it in full, within the round
                server_round=server_round,
                timeout=timeout,
                quorum=self.quorum,
                grace_s=self.grace_s,
            )
            del messages
            self.book.bytes_down += take.close(self.server_round)  # full models resent
            new_arrays, train_metrics = train.finish(wait)
        finally:
            train.close()
        return RoundOutcome(
            new_arrays,
            train_metrics,
            federated_evaluation(self, grid, server_round, evaluate_config, timeout),
        )

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Weighted mean of the valid replies' metrics (bad replies dropped, never raises)."""
        replies, ledger = list(replies), self.book.eval_ledger
        agg = aggregate_metrics(self.eval_validator, replies, ledger, self.evaluate_metrics_aggr_fn)
        return downloads.evaluated(self, ledger, replies, agg)

    # ------------------------------------------------------------------ checkpoint extras
    def state_dict(self) -> dict[str, Any]:
        """:meth:`DiLoCoState.state_dict` plus the DP, download and asynchronous state."""
        sd = super().state_dict()
        if self.weight_reference is not None:
            sd["meta"]["weight_reference"] = self.weight_reference
        if self.dp.state() is not None:
            sd["meta"]["dp"] = self.dp.state()
        if self.broadcast is not None and self.broadcast.base is not None:
            sd["tensors"]["broadcast"], sd["meta"]["broadcast"] = downloads.broadcast_state(self)
        if self.async_rounds is not None:  # the tasks in flight and the models they train from
            self.async_rounds.save(sd, self.server_round)
        return sd

    @staticmethod
    def _state_spec() -> dict[str, Any]:
        from flwr_isoloco.checkpoint.spec import Field

        spec = DiLoCoState._state_spec()
        spec["weight_reference"] = Field("float", min=0, optional=True)
        spec["dp"] = Field("dict", optional=True)  # Flower's accountant state (privacy.py)
        spec["broadcast"] = Field("dict", optional=True)  # B's digest (downloads.py)
        spec["async"] = asyn.state_spec()  # asynchronous rounds' tasks
        return spec

    def load_state_dict(
        self, state: Mapping[str, Any], reference: Mapping[str, Any] | None = None
    ) -> None:
        """Restore :meth:`state_dict`'s output, all checked before anything is set."""
        from flwr_isoloco.checkpoint.spec import CheckpointError

        meta = state.get("meta") if isinstance(state, Mapping) else None
        dp = self.dp.accountant, self.dp.noise_key, self.dp.c
        if isinstance(meta, Mapping) and isinstance(meta.get("server_round"), int):
            try:
                dp = self.dp.parse_state(meta.get("dp"), meta["server_round"])
            except ValueError as exc:
                raise CheckpointError(f"DP accountant: {exc}") from None
        try:
            broadcast = downloads.parse_broadcast(self, state)  # None: no codec, or no B saved
        except ValueError as exc:
            raise CheckpointError(f"broadcast model: {exc}") from None
        tasks = asyn.parse_checkpoint(self, state)  # asynchronous rounds' versions and tasks
        super().load_state_dict(state, reference)
        if tasks is not None:
            self.async_rounds.restore(*tasks)
        if broadcast is not None:
            self.broadcast = broadcast
        self.dp.restore(dp)
        ref = state["meta"].get("weight_reference")
        self.weight_reference = None if ref is None else float(ref)

    # ------------------------------------------------------------------ maths glue
    def outer_step(self, g: Mapping[str, torch.Tensor]) -> None:
        """``theta <- theta - lr u`` (parameters); ``theta_b <- base_b - g_b`` (buffers)."""
        assert self.theta is not None
        buffers = buffer_keys(self)
        params = {k: self.theta[k] for k in g if k not in buffers}
        transform = self.merger.update_transform(self.server_round)
        new = downloads.outer_or_exact(self, params, g, transform)  # exact download: its step
        base = downloads.train_base(self.broadcast, self.theta)  # the model sent: B or theta
        new.update(merged_buffers(base, g, buffers))  # a noised variance is clamped at 0
        for k in buffers:  # a checkpoint from before buffers were told apart may hold some
            self.outer.momentum_buffer.pop(k, None)
        self.theta = {**self.theta, **{k: v.float() for k, v in new.items()}}


# ---------------------------------------------------------------------- the strategy's helpers
def record_of(s: DiLoCo, model: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """``model`` (fp32, as ``theta``) as a record in strategy ``s``'s model dtypes."""
    return ArrayRecord({k: v.to(s.dtypes.get(k, v.dtype)) for k, v in model.items()})


def sample_nodes(s: DiLoCo, grid: Grid, fraction: float, min_nodes: int) -> list[int]:
    """``k = max(floor(fraction N), min_nodes)`` of the ``N`` connected nodes, drawn with
    ``s``'s seeded generator once ``max(min_available_nodes, k)`` are connected. The wait is
    bounded by the round timeout given to ``start``
    (:func:`~flwr_isoloco.strategies.core.nodes.nodes_for_round`): then the run goes on with the
    connected nodes if they make the ``Rounds.quorum``, else it stops with
    :class:`~flwr_isoloco.strategies.core.nodes.NodeWaitError` (the run ends failed)."""
    connected = list(grid.get_node_ids())
    k = max(int(len(connected) * fraction), min_nodes)
    all_nodes = nodes_for_round(
        grid,
        max(s.min_available_nodes, k),
        timeout_s=getattr(s, "_round_timeout", None) or DEFAULT_NODE_WAIT_S,
        quorum=s.quorum,
        what="DiLoCo",
    )
    return draw(s, all_nodes, k)


def draw(s: DiLoCo, nodes: list[int], k: int) -> list[int]:
    """``min(k, len(nodes))`` of ``nodes``, drawn with ``s``'s seeded generator."""
    return s._rng.sample(nodes, min(k, len(nodes)))


def federated_evaluation(
    s: DiLoCo, grid: Grid, server_round: int, evaluate_config: Any, timeout: float | None
) -> Any:
    """The round's federated evaluation of ``s``'s current model (replies as they arrive, with
    the strategy's quorum and grace window); None when it sends nothing."""
    return evaluation_round(
        s._eval_stream,
        grid,
        s.configure_evaluate(server_round, s.current_arrays(), evaluate_config, grid),
        s.aggregate_evaluate,
        server_round=server_round,
        timeout=timeout,
        quorum=s.quorum,
        grace_s=s.grace_s,
    )
