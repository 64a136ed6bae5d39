"""DiLoCo and IsoLoCo as Flower Message-API strategies.

Each round the server sends the global model ``theta`` to the sampled nodes; node ``i`` trains
and replies FedAvg-style (its weights ``theta_i`` under ``arrays``, ``num-examples`` in a
MetricRecord), or its delta (ConfigRecord ``payload="delta"``, or ``client_sends="delta"``).
The server forms the pseudo-gradients ``delta_i = theta - theta_i``, merges them

    g = merge(delta_1..delta_M; w),   w_i = num-examples_i  (or 1 with ``weighting="uniform"``)

and applies the outer optimiser (``torch.optim.SGD`` convention, dampening 0)::

    b <- mu*b + g;  u = g + mu*b (Nesterov) | b (heavy-ball) | g (mu = 0)
    u <- iso_c(u)   (only with orthogonalize="update")
    theta <- theta - lr*u

``DiLoCo(merge="mean", outer_lr=1.0, outer_momentum=0.0)`` is FedAvg. Bad replies are dropped
with a logged reason (:mod:`~flwr_isoloco.strategies.core.replies`); replies are merged in
content-digest order (not node-id order); node sampling and DARE masks come from ``seed``. Round merge: :mod:`flwr_isoloco.merging.round`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_isoloco.compression import payload_nbytes, request_config
from flwr_isoloco.merging import resolve_device
from flwr_isoloco.merging.buffers import check_buffers_spec
from flwr_isoloco.strategies.core.divergence import DEFAULT_DIVERGENCE_FACTOR
from flwr_isoloco.strategies.core.evaluation import aggregate_metrics, evaluation_round
from flwr_isoloco.strategies.core.guard import EmptyRoundGuard
from flwr_isoloco.strategies.core.ledger import SentLedger
from flwr_isoloco.strategies.core.lifecycle import ResumableStrategy, RoundOutcome
from flwr_isoloco.strategies.core.nodes import DEFAULT_NODE_WAIT_S, nodes_for_round
from flwr_isoloco.strategies.core.replies import CheckedReply
from flwr_isoloco.strategies.core.rounds import ReplyStream, check_quorum
from flwr_isoloco.strategies.diloco.config import (
    DEFAULT_MAX_WEIGHT_RATIO,
    DILOCO_RUN_CONFIG,
    ISOLOCO_RUN_CONFIG,
    FromRunConfig,
    check_arguments,
)
from flwr_isoloco.strategies.diloco.privacy import DEFAULT_CLIP_LR, DEFAULT_DP_DELTA, StrategyDP
from flwr_isoloco.strategies.diloco.setup import (
    DP_ARGUMENTS,
    PLAIN_ARGUMENTS,
    buffer_keys,
    outer_optimizer,
    setup_merge,
    validators,
)
from flwr_isoloco.strategies.diloco.state import DiLoCoState, log_summary
from flwr_isoloco.strategies.diloco.train_round import TrainRound

__all__ = ["DiLoCo", "DILOCO_RUN_CONFIG", "ISOLOCO_RUN_CONFIG"]


class DiLoCo(FromRunConfig, DiLoCoState, ResumableStrategy):
    """DiLoCo: merge the nodes' pseudo-gradients, then an outer SGD/Nesterov step.

    Parameters (keyword-only; the first ten are FedAvg's)
    ----------
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes,
    min_available_nodes, weighted_by_key, arrayrecord_key, configrecord_key :
        As in ``flwr.serverapp.strategy.FedAvg``.
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn :
        Optional ``fn(list[RecordDict], weighted_by_key) -> MetricRecord`` for client metrics
        (default: weighted mean of every scalar metric over the valid replies).
    merge : str or MergeRule
        Merge rule for ``g`` (a name from ``flwr_isoloco.merging.MERGE_RULES``).
    merge_options : dict
        Options for the rule (``prune_fraction``, ``drop_rate``, ``common_fraction``,
        ``ns_steps``, ``spectral_pattern``...). DARE's ``seed`` is derived per round from
        ``seed`` unless given.
    outer_lr, outer_momentum, nesterov :
        Outer optimiser ``lr``, ``mu`` and Nesterov switch (ignored when ``mu = 0``).
    orthogonalize : "gradient" | "update"
        ``"gradient"``: the rule merges ``g``. ``"update"``: ``g`` is the weighted mean and the
        rule (``iso_c`` or ``iso_c_ns``) is applied to the outer update ``u`` after momentum.
    weighting : "examples" | "uniform"
        ``w_i = num-examples_i`` or ``w_i = 1``.
    client_sends : "weights" | "delta"
        What clients reply by default (a reply's ConfigRecord ``payload`` overrides it).
    max_update_norm, max_norm_ratio :
        Optional bounds on ``||delta_i||_2`` (absolute; relative to the median of the others).
    max_weight_ratio : float
        Each reply's weight is clipped to ``max_weight_ratio x`` the round's median weight
        (default 5; ``0`` or ``None`` = off), so no one site owns the merge.
    max_empty_rounds : int
        Stop with :class:`~flwr_isoloco.strategies.core.guard.NoProgressError` when this many
        consecutive rounds used no reply (default 3; ``0`` = never).
    dtype_policy : "cast" | "reject"
        What to do with a reply array of another floating dtype.
    seed : int
        Seed for node sampling and DARE masks.
    upload_codec, codec_options, error_feedback :
        Ask workers to upload their delta compressed (``"int8"``, ``"fp8"``, ``"topk"``; None or
        ``"none"``: plain replies) with these options (``block_size``, ``fraction``, ``values``,
        ``min_dims``) and error feedback; see :mod:`flwr_isoloco.compression`. Compressed
        replies are decoded before validation; plain fp32 replies stay accepted.
    on_divergence, divergence_factor, divergence_key :
        The divergence guard (:mod:`~flwr_isoloco.strategies.core.divergence`): ``"warn"``
        (default) | ``"skip"`` | ``"stop"`` when the ``evaluate_fn`` loss is non-finite,
        above ``divergence_factor`` (default 1.5; 0 = non-finite only) x the previous round's,
        or above 1.5 x the best so far (a slow collapse; ``collapse_factor`` of
        ``set_divergence_guard``).
    merge_device : "auto" | "cpu" | "cuda" | "cuda:<index>"
        Where the server merge computes (:func:`~flwr_isoloco.merging.resolve_device`):
        ``"auto"`` (default) is CUDA where ``torch.cuda.is_available()``, else the CPU. The
        model and every result stay on the CPU; one tensor's slices move at a time. A CUDA
        device that is not there is refused here, at construction.
    dp_noise_multiplier, dp_clipping_norm, dp_delta, dp_max_epsilon :
        Central DP (:mod:`~flwr_isoloco.strategies.diloco.privacy`): each pseudo-
        gradient clipped to L2 norm ``C = dp_clipping_norm`` (None: off), weights uniform,
        ``N(0, (z C)^2)`` with ``z = dp_noise_multiplier`` added to the sum before the outer
        step, divided by the number of nodes sampled. Epsilon at ``dp_delta`` (default 1e-5)
        is the ``dp-epsilon`` metric; a round that would pass ``dp_max_epsilon`` is not sent
        (``PrivacyBudgetExhausted``). Mean-based rules only (mean, Iso-C), no ``max_norm_ratio``.
    dp_seed : int or None
        Key of the DP noise, drawn per ``(key, round, tensor, attempt)``. None (default): a
        secret key from the OS, kept in the checkpoint (resume draws the same noise; a round
        redone after a crash draws new noise, and resuming needs the DP journal:
        ``strategy.dp.attach_journal(path)``, :mod:`~flwr_isoloco.strategies.diloco.dp_journal`). An
        int makes the noise reproducible, and removable by anyone who knows it: tests only.
    dp_mode : "central" | "local"
        ``"local"``: each worker clips its delta to ``C`` and adds ``N(0, (z C)^2)`` itself,
        before compression and error feedback (the DiLoCo worker does when the train config
        asks); every merge rule and option is then allowed, replies without the echo are
        dropped, and ``dp-epsilon`` is each site's own (multiplier ``z / 2``: replace-one).
    dp_adaptive_quantile, dp_clip_lr, dp_clip_count_std :
        Adaptive clipping (central DP with noise; Andrew et al. 2021): ``dp_clipping_norm`` is
        the initial ``C``, moved after each round towards the ``dp_adaptive_quantile`` quantile
        of the update norms, ``C <- C exp(-dp_clip_lr (b - q))``, ``b`` the unclipped fraction
        noised with std ``dp_clip_count_std`` (required, ``> z / 2``). ``z`` stays the
        accounted multiplier; the update sum gets ``(z^-2 - (2 dp_clip_count_std)^-2)^-1/2``.
    robust, robust_options :
        Robust aggregation of the pseudo-gradients, replacing the mean before the rule (Iso-C)
        and the outer step (:mod:`flwr_isoloco.merging.robust`): ``"none"`` (default),
        ``"median"``, ``"trimmed-mean"`` (option ``trim``, default 0.25), ``"krum"`` (``f``),
        ``"multikrum"`` (``f``, ``select``), ``"norm-clip"`` (to the round's median norm),
        ``"distance-filter"`` (``factor``, default 2: leaves out updates farther from the
        coordinate-wise median than ``factor x`` the median such distance).
    buffers : "auto" | "none" | regex | names | callable | nn.Module
        The float tensors that are not trained by gradients (BatchNorm running statistics):
        merged as FedAvg merges them, ``theta_b <- sum_i w_i theta_b,i / sum_i w_i`` (the
        round's merge weights; no merge rule, no outer step, no momentum); the outer step owns
        the rest. ``"auto"`` (default): names ending in ``running_*`` / ``moving_*`` and the
        like (:mod:`flwr_isoloco.merging.buffers`); ``"none"``: every float tensor is a
        parameter; a regex, a list of names, ``fn(name, tensor) -> bool`` or a module whose
        ``named_buffers()`` they are. Under central DP they are in the clipped, noised delta.
    """

    secagg: Any = None
    """None, or the SecAgg+ shim that :func:`~flwr_isoloco.strategies.diloco.secagg.use_secagg` set."""

    def __init__(
        self,
        *,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        train_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
        evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
        merge: Any = "mean",
        merge_options: Mapping[str, Any] | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        orthogonalize: str = "gradient",
        weighting: str = "examples",
        client_sends: str = "weights",
        max_update_norm: float | None = None,
        max_norm_ratio: float | None = None,
        max_weight_ratio: float | None = DEFAULT_MAX_WEIGHT_RATIO,
        max_empty_rounds: int = 3,
        dtype_policy: str = "cast",
        seed: int = 0,
        upload_codec: str | None = None,
        codec_options: Mapping[str, Any] | None = None,
        error_feedback: bool = True,
        quorum: float | int | None = None,
        grace_s: float = 0.0,
        on_divergence: str = "warn",
        divergence_factor: float = DEFAULT_DIVERGENCE_FACTOR,
        divergence_key: str | None = None,
        merge_device: str = "auto",
        dp_noise_multiplier: float | None = None,
        dp_clipping_norm: float | None = None,
        dp_delta: float = DEFAULT_DP_DELTA,
        dp_max_epsilon: float | None = None,
        dp_seed: int | None = None,
        dp_mode: str = "central",
        dp_adaptive_quantile: float | None = None,
        dp_clip_lr: float = DEFAULT_CLIP_LR,
        dp_clip_count_std: float | None = None,
        robust: str | None = "none",
        robust_options: Mapping[str, Any] | None = None,
        buffers: Any = "auto",
    ) -> None:
        args = dict(locals())  # every argument by name, for the checks and setters below
        self.quorum, self.grace_s = check_quorum(quorum, grace_s)
        self.merge_device = resolve_device(merge_device)  # ValueError: e.g. "cuda" without a GPU
        self.set_divergence_guard(on_divergence, divergence_factor, divergence_key)
        check_arguments(**args)  # fractions, node counts, choices, seed, max_weight_ratio
        self.max_weight_ratio = float(max_weight_ratio or 0.0)
        self._guard = EmptyRoundGuard(max_empty_rounds, "aggregate_train")
        setup_merge(self, merge, merge_options, orthogonalize, seed, robust, robust_options)
        self.buffers = check_buffers_spec(buffers)  # float tensors the outer step does not own
        self.codec_request = request_config(upload_codec, codec_options, error_feedback)  # checks
        self.upload_codec = upload_codec or "none"
        self._bytes_down = 0
        self.fraction_train = float(fraction_train)
        self.fraction_evaluate = float(fraction_evaluate)
        self.min_train_nodes = 0 if fraction_train == 0 else min_train_nodes
        self.min_evaluate_nodes = 0 if fraction_evaluate == 0 else min_evaluate_nodes
        for name in PLAIN_ARGUMENTS:  # weighted_by_key, the record keys, seed...: as given
            setattr(self, name, args[name])
        self.outer = outer_optimizer(outer_lr, outer_momentum, nesterov)
        self.train_validator, self.eval_validator = validators(
            self, dtype_policy, max_update_norm, max_norm_ratio
        )
        self._reset_bookkeeping(seed)
        self.dp = StrategyDP(*(args[name] for name in DP_ARGUMENTS))
        self.dp.check_strategy(self)  # refuses rules / options DP cannot bound; weights uniform

    def _reset_bookkeeping(self, seed: int) -> None:
        """No model, no round aggregated yet; sampling from ``seed``; empty ledgers, streams."""
        self._train_ledger, self._eval_ledger = SentLedger(), SentLedger()
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

    @property
    def theta(self) -> dict[str, torch.Tensor] | None:
        """The fp32 master copy of the model (replaced each step, never changed in place)."""
        return self.__dict__.get("_theta")

    @theta.setter
    def theta(self, value: dict[str, torch.Tensor] | None) -> None:
        self.__dict__["_theta"] = value
        self.__dict__["_record"] = None  # the record of the old theta is not this model's

    def _model_record(self) -> ArrayRecord:
        """``theta`` in the model's dtypes, built once per ``theta``: the record sent, the
        round's result, the evaluated and checkpointed model are then one copy, not one each."""
        assert self.theta is not None
        cached = self.__dict__.get("_record")
        if cached is not None and cached[0] is self._dtypes:  # dtypes: replaced, never changed
            return cached[1]
        record = ArrayRecord({k: v.to(self._dtypes.get(k, v.dtype)) for k, v in self.theta.items()})
        self.__dict__["_record"] = (self._dtypes, record)
        return record

    @property
    def completed_rounds(self) -> int:
        """Rounds aggregated so far (``server_round``; continues across a resume)."""
        return self.server_round

    def current_arrays(self) -> ArrayRecord:
        """``theta`` in the model's own dtypes."""
        return self._model_record()

    def prepare(self, grid: Grid, initial_arrays: ArrayRecord, timeout: float) -> None:
        """Adopt ``initial_arrays``; a restored strategy keeps its ``theta`` (same keys).
        ``timeout`` also bounds each round's wait for nodes (:meth:`_sample`)."""
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

    def _sample(self, grid: Grid, fraction: float, min_nodes: int) -> list[int]:
        """``k = max(floor(fraction N), min_nodes)`` of the ``N`` connected nodes, drawn with
        the seeded generator, once ``max(min_available_nodes, k)`` are connected. The wait is
        bounded by the round timeout given to ``start`` (:func:`~flwr_isoloco.strategies.core.nodes.nodes_for_round`): then
        the run goes on with the connected nodes if they make the ``quorum``, else it stops
        with :class:`~flwr_isoloco.strategies.core.nodes.NodeWaitError` (the run ends failed)."""
        connected = list(grid.get_node_ids())
        k = max(int(len(connected) * fraction), min_nodes)
        all_nodes = nodes_for_round(
            grid,
            max(self.min_available_nodes, k),
            timeout_s=getattr(self, "_round_timeout", None) or DEFAULT_NODE_WAIT_S,
            quorum=self.quorum,
            what="DiLoCo",
        )
        k = min(k, len(all_nodes))
        return self._rng.sample(all_nodes, k)

    def _messages(
        self, arrays: ArrayRecord, config: ConfigRecord, nodes: list[int], mtype: str
    ) -> list[Message]:
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
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
        nodes = self._sample(grid, self.fraction_train, self.min_train_nodes)
        log(INFO, "configure_train: sampled %d nodes", len(nodes))
        config["server-round"] = self.server_round + 1
        for k, v in {**self.codec_request, **self.dp.request()}.items():
            config[k] = v
        record = self._model_record()
        self._bytes_down = payload_nbytes(record) * len(nodes)
        return self._train_ledger.remember(self._messages(record, config, nodes, MessageType.TRAIN))

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the current ``theta`` to the sampled nodes for evaluation."""
        if self.fraction_evaluate == 0.0:
            return []
        if self.theta is None:
            self._adopt(arrays)
        nodes = self._sample(grid, self.fraction_evaluate, self.min_evaluate_nodes)
        config["server-round"] = self.server_round
        return self._eval_ledger.remember(
            self._messages(self._model_record(), config, nodes, MessageType.EVALUATE)
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate, bound the weights, merge and take the outer step.

        A bad reply is dropped and named, never the round; the counts logged and returned
        agree. Raises :class:`~flwr_isoloco.strategies.core.guard.NoProgressError` only when
        ``max_empty_rounds`` consecutive rounds used no reply.
        """
        self.server_round += 1
        if self.theta is None:
            log(WARNING, "aggregate_train: no global model yet (configure_train not called)")
            return None, None
        train = TrainRound(self, self.server_round)
        try:
            for msg in replies:
                train.take(msg)
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
        """Train then evaluate; replies are taken as they arrive (:mod:`~flwr_isoloco.strategies.core.rounds`), each train
        reply folded into the merge at once (:class:`.train_round.TrainRound`); an evaluation
        that sends nothing is skipped (:func:`~flwr_isoloco.strategies.core.evaluation.evaluation_round`)."""
        if self.secagg is not None:  # the train half under SecAgg+ (strategies/diloco/secagg.py)
            return self.secagg.run_round(
                self, grid, server_round, train_config, evaluate_config, timeout
            )
        arrays = self.current_arrays()
        messages = list(self.configure_train(server_round, arrays, train_config, grid))
        del arrays
        self.server_round += 1
        train = TrainRound(self, self.server_round)
        try:
            wait = self._train_stream.run(
                grid,
                messages,
                train.take,
                server_round=server_round,
                timeout=timeout,
                quorum=self.quorum,
                grace_s=self.grace_s,
            )
            del messages
            new_arrays, train_metrics = train.finish(wait)
        finally:
            train.close()
        return RoundOutcome(
            new_arrays,
            train_metrics,
            self.evaluate_half(grid, server_round, evaluate_config, timeout),
        )

    def evaluate_half(
        self, grid: Grid, server_round: int, evaluate_config: Any, timeout: float | None
    ) -> Any:
        """The round's federated evaluation of the current model (replies as they arrive,
        with the strategy's quorum and grace window); None when it sends nothing."""
        return evaluation_round(
            self._eval_stream,
            grid,
            self.configure_evaluate(server_round, self.current_arrays(), evaluate_config, grid),
            self.aggregate_evaluate,
            server_round=server_round,
            timeout=timeout,
            quorum=self.quorum,
            grace_s=self.grace_s,
        )

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Weighted mean of the valid replies' metrics (bad replies dropped, never raises)."""
        return aggregate_metrics(
            self.eval_validator, replies, self._eval_ledger, self.evaluate_metrics_aggr_fn
        )

    # ------------------------------------------------------------------ checkpoint extras
    def state_dict(self) -> dict[str, Any]:
        """:meth:`DiLoCoState.state_dict` plus the weight bound's reference weight."""
        sd = super().state_dict()
        if self.weight_reference is not None:
            sd["meta"]["weight_reference"] = self.weight_reference
        if self.dp.state() is not None:
            sd["meta"]["dp"] = self.dp.state()
        return sd

    @staticmethod
    def _state_spec() -> dict[str, Any]:
        from flwr_isoloco.checkpoint_spec import Field

        spec = DiLoCoState._state_spec()
        spec["weight_reference"] = Field("float", min=0, optional=True)
        spec["dp"] = Field("dict", optional=True)  # Flower's accountant state (privacy.py)
        return spec

    def load_state_dict(
        self, state: Mapping[str, Any], reference: Mapping[str, Any] | None = None
    ) -> None:
        """:meth:`DiLoCoState.load_state_dict`; restores the reference weight (None if absent)
        and the DP accountant (epsilon continues; checked before anything is set)."""
        from flwr_isoloco.checkpoint_spec import CheckpointError

        meta = state.get("meta") if isinstance(state, Mapping) else None
        dp = self.dp.accountant, self.dp.noise_key, self.dp.c
        if isinstance(meta, Mapping) and isinstance(meta.get("server_round"), int):
            try:
                dp = self.dp.parse_state(meta.get("dp"), meta["server_round"])
            except ValueError as exc:
                raise CheckpointError(f"DP accountant: {exc}") from None
        super().load_state_dict(state, reference)
        self.dp.restore(dp)
        ref = state["meta"].get("weight_reference")
        self.weight_reference = None if ref is None else float(ref)

    # ------------------------------------------------------------------ maths glue
    def _weight(self, reply: CheckedReply) -> float:
        return 1.0 if self.weighting == "uniform" else reply.weight

    def _outer_step(self, g: Mapping[str, torch.Tensor]) -> None:
        """``theta <- theta - lr u`` (OuterSGD; ``u`` orthogonalised with "update") for the
        parameters; ``theta_b <- theta_b - g_b`` (the nodes' weighted mean) for the buffers."""
        assert self.theta is not None
        buffers = buffer_keys(self)
        params = {k: self.theta[k] for k in g if k not in buffers}
        transform = self.merger.update_transform(self.server_round)
        new = self.outer.step(params, {k: g[k] for k in params}, update_transform=transform)
        new.update({k: self.theta[k] - g[k].to(self.theta[k].dtype) for k in g if k in buffers})
        for k in buffers:  # a checkpoint from before buffers were told apart may hold some
            self.outer.momentum_buffer.pop(k, None)
        self.theta = {**self.theta, **{k: v.float() for k, v in new.items()}}
