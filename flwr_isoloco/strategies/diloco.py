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

``DiLoCo(merge="mean", outer_lr=1.0, outer_momentum=0.0)`` is FedAvg. IsoLoCo is DiLoCo with
``merge="iso_c"`` (mean on non-2-D tensors), ``outer_lr=1.8``, ``outer_momentum=0.8``.

Bad replies are dropped with a logged reason (see :mod:`flwr_isoloco.strategies.common`); if no
reply is usable the model is kept. Replies are merged in the order of their content digests, so the result depends neither on
arrival order nor on node ids. All random choices (node sampling, DARE masks) come from ``seed``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from flwr_isoloco.compression import CODECS, payload_nbytes, request_config
from flwr_isoloco.merging import MERGE_RULES, StreamingMerger, merge
from flwr_isoloco.merging.rules import check_options
from flwr_isoloco.merging.validation import all_finite
from flwr_isoloco.merging.weights import bounded_weights
from flwr_isoloco.outer import OuterSGD
from flwr_isoloco.strategies.common import (
    PAYLOADS,
    CheckedReply,
    EmptyRoundGuard,
    ReplyReport,
    ReplyValidator,
    SentLedger,
    metric_record,
    tensor_norm,
    weighted_mean_metrics,
)

__all__ = ["DiLoCo", "IsoLoCo", "DILOCO_RUN_CONFIG", "ISOLOCO_RUN_CONFIG"]

ORTHOGONALIZE = ("gradient", "update")
WEIGHTINGS = ("examples", "uniform")
_SPECTRAL_FOR_UPDATE = ("iso_c", "iso_c_ns")

DEFAULT_MAX_WEIGHT_RATIO = 5.0
"""No reply's weight counts for more than 5 x the round's median weight (docs/strategies.md)."""

# Run-config keys (flat Flower keys, prefix "strategy."), with their defaults. Merge options set
# to -1 / "" mean "the merge rule's own default". 0 for the norm bounds means "off".
DILOCO_RUN_CONFIG: dict[str, Any] = {
    "merge": "mean",
    "outer-lr": 0.7,
    "outer-momentum": 0.9,
    "nesterov": True,
    "orthogonalize": "gradient",
    "weighting": "examples",
    "client-sends": "weights",
    "fraction-train": 1.0,
    "fraction-evaluate": 1.0,
    "min-train-nodes": 2,
    "min-evaluate-nodes": 2,
    "min-available-nodes": 2,
    "max-update-norm": 0.0,
    "max-norm-ratio": 0.0,
    "max-weight-ratio": DEFAULT_MAX_WEIGHT_RATIO,
    "max-empty-rounds": 3,
    "dtype-policy": "cast",
    "seed": 0,
    "prune-fraction": -1.0,
    "drop-rate": -1.0,
    "common-fraction": -1.0,
    "ns-steps": -1,
    "spectral-pattern": "",
    "upload-codec": "none",
    "codec-block-size": 256,
    "codec-fraction": 0.01,
    "codec-values": "fp32",
    "codec-min-dims": 2,
    "error-feedback": True,
}
ISOLOCO_RUN_CONFIG: dict[str, Any] = {
    **DILOCO_RUN_CONFIG,
    "merge": "iso_c",
    "outer-lr": 1.8,
    "outer-momentum": 0.8,
}
_MERGE_OPTION_KEYS = {
    "prune-fraction": "prune_fraction",
    "drop-rate": "drop_rate",
    "common-fraction": "common_fraction",
    "ns-steps": "ns_steps",
    "spectral-pattern": "spectral_pattern",
}


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _codec_options(c: Mapping[str, Any]) -> dict[str, Any]:
    """The chosen codec's options from the flat ``codec-*`` run-config keys."""
    from flwr_isoloco.compression import OPTION_KEYS, normalize_options

    codec = c["upload-codec"]
    allowed = normalize_options(codec)
    return {o: c[k] for k, o in OPTION_KEYS.items() if o in allowed}


def _off_or_at_least_one(value: float) -> None:
    if value != 0 and not value >= 1:
        raise ValueError("must be >= 1, or 0 for off")


def _split_state(tree: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a nested dict into (tensors only, everything else) with the same nesting."""
    tensors: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, torch.Tensor):
            tensors[k] = v.detach().clone()
        elif isinstance(v, Mapping):
            t, m = _split_state(v)
            if t or not m:
                tensors[k] = t
            if m:
                meta[k] = m
        else:
            meta[k] = v
    return tensors, meta


def _join_state(tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = dict(meta)
    for k, v in tensors.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _join_state(v, out[k])
        else:
            out[k] = v
    return out


def _finite(g: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``g`` itself, or ``ValueError`` naming the first tensor with non-finite values."""
    for k, t in g.items():
        if not all_finite(t):
            raise ValueError(f"merged tensor {k!r} has non-finite values")
    return g


class DiLoCo(Strategy):
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
        Stop with :class:`~flwr_isoloco.strategies.common.NoProgressError` when this many
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
    """

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
    ) -> None:
        for name, v in (
            ("fraction_train", fraction_train),
            ("fraction_evaluate", fraction_evaluate),
        ):
            if not _is_number(v) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")
        for name, v in (
            ("min_train_nodes", min_train_nodes),
            ("min_evaluate_nodes", min_evaluate_nodes),
            ("min_available_nodes", min_available_nodes),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if orthogonalize not in ORTHOGONALIZE:
            raise ValueError(f"orthogonalize must be one of {ORTHOGONALIZE}, got {orthogonalize!r}")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        if client_sends not in PAYLOADS:
            raise ValueError(f"client_sends must be one of {PAYLOADS}, got {client_sends!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if max_weight_ratio is not None and not (
            _is_number(max_weight_ratio) and (max_weight_ratio == 0 or max_weight_ratio >= 1)
        ):
            raise ValueError(
                f"max_weight_ratio must be >= 1, or 0/None for off, got {max_weight_ratio!r}"
            )
        self.max_weight_ratio = float(max_weight_ratio or 0.0)
        self._guard = EmptyRoundGuard(max_empty_rounds, "aggregate_train")
        self.rule, self.merge_name = self._resolve_rule(merge)
        if orthogonalize == "update" and self.merge_name not in _SPECTRAL_FOR_UPDATE:
            raise ValueError(
                f"orthogonalize='update' needs merge in {_SPECTRAL_FOR_UPDATE}, got {self.merge_name!r}"
            )
        # Unknown codec / option -> ValueError naming it.
        self.codec_request = request_config(upload_codec, codec_options, error_feedback)
        self.upload_codec = upload_codec or "none"
        self._bytes_down = 0
        self.merge_options = dict(merge_options or {})
        check_options(self.rule, self.merge_options)  # unknown option / bad value -> ValueError
        self.fraction_train = float(fraction_train)
        self.fraction_evaluate = float(fraction_evaluate)
        self.min_train_nodes = 0 if fraction_train == 0 else min_train_nodes
        self.min_evaluate_nodes = 0 if fraction_evaluate == 0 else min_evaluate_nodes
        self.min_available_nodes = min_available_nodes
        self.weighted_by_key = weighted_by_key
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.train_metrics_aggr_fn = train_metrics_aggr_fn
        self.evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn
        self.orthogonalize = orthogonalize
        self.weighting = weighting
        self.client_sends = client_sends
        self.seed = seed
        # OuterSGD validates lr / momentum (ValueError naming them).
        mu = float(outer_momentum) if _is_number(outer_momentum) else outer_momentum
        self.outer = OuterSGD(outer_lr, mu, bool(nesterov) and _is_number(mu) and mu > 0)
        self.train_validator = ReplyValidator(
            arrayrecord_key=arrayrecord_key,
            weighted_by_key=weighted_by_key,
            dtype_policy=dtype_policy,
            max_update_norm=max_update_norm or None,
            max_norm_ratio=max_norm_ratio or None,
            default_payload=client_sends,
            what="aggregate_train",
        )
        self.eval_validator = ReplyValidator(
            arrayrecord_key=arrayrecord_key,
            weighted_by_key=weighted_by_key,
            require_arrays=False,
            what="aggregate_evaluate",
        )
        self._train_ledger = SentLedger()
        self._eval_ledger = SentLedger()
        self._rng = random.Random(seed)
        self.theta: dict[str, torch.Tensor] | None = None  # fp32 master copy
        self._dtypes: dict[str, torch.dtype] = {}
        self.server_round = 0  # rounds aggregated so far (continues across resume)

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _resolve_rule(merge_rule: Any) -> tuple[Any, str]:
        if isinstance(merge_rule, str):
            if merge_rule not in MERGE_RULES:
                raise ValueError(
                    f"unknown merge rule {merge_rule!r}; expected one of {sorted(MERGE_RULES)}"
                )
            return MERGE_RULES[merge_rule], merge_rule
        name = getattr(merge_rule, "name", None)
        if name is None or not hasattr(merge_rule, "streaming"):
            raise ValueError(f"merge must be a rule name or a MergeRule, got {merge_rule!r}")
        return merge_rule, str(name)

    RUN_CONFIG_DEFAULTS = DILOCO_RUN_CONFIG

    @classmethod
    def from_run_config(
        cls,
        run_config: Mapping[str, Any],
        prefix: str = "strategy.",
        ignore: Iterable[str] = ("name", "timeout", "round-timeout"),
        **overrides: Any,
    ) -> DiLoCo:
        """Build from Flower's flat run config (keys ``strategy.<key>``, see ``RUN_CONFIG_DEFAULTS``).

        Keys outside ``prefix`` are ignored, as are ``prefix + k`` for ``k`` in ``ignore`` (the
        app's own keys such as ``strategy.name``). An unknown ``strategy.*`` key, a value of the
        wrong type, an unknown merge rule or a negative lr raise ``ValueError`` naming it.
        ``overrides`` are constructor arguments applied last.
        """
        from flwr_isoloco.runconfig import choices, in_range, non_negative, read_run_config

        skip = {prefix + k for k in ignore}
        mine = {k: v for k, v in run_config.items() if k.startswith(prefix) and k not in skip}
        # Nest the schema under the prefix so that errors name the full key (strategy.outer-lr).
        schema: dict[str, Any] = dict(cls.RUN_CONFIG_DEFAULTS)
        for part in reversed([p for p in prefix.split(".") if p]):
            schema = {part: schema}
        checks = {
            "merge": choices(*MERGE_RULES),
            "outer-lr": non_negative,
            "outer-momentum": non_negative,
            "fraction-train": in_range(0, 1),
            "fraction-evaluate": in_range(0, 1),
            "min-train-nodes": non_negative,
            "min-evaluate-nodes": non_negative,
            "min-available-nodes": non_negative,
            "max-update-norm": non_negative,
            "max-norm-ratio": non_negative,
            "max-weight-ratio": _off_or_at_least_one,
            "max-empty-rounds": non_negative,
            "orthogonalize": choices(*ORTHOGONALIZE),
            "weighting": choices(*WEIGHTINGS),
            "client-sends": choices(*PAYLOADS),
            "dtype-policy": choices("cast", "reject"),
            "upload-codec": choices(*CODECS),
            "codec-values": choices("fp32", "int8"),
            "codec-block-size": in_range(1, 1 << 20),
            "codec-min-dims": in_range(0, 8),
            "codec-fraction": in_range(0, 1, lo_open=True),
        }
        cfg = read_run_config(mine, schema, {prefix + k: v for k, v in checks.items()})
        for part in [p for p in prefix.split(".") if p]:
            cfg = cfg[part]
        c = {k: cfg[k] for k in cls.RUN_CONFIG_DEFAULTS}
        options = {}
        for key, opt in _MERGE_OPTION_KEYS.items():
            v = c[key]
            if (isinstance(v, str) and v != "") or (not isinstance(v, str) and v >= 0):
                options[opt] = v
        kwargs = dict(
            merge=c["merge"],
            merge_options=options,
            outer_lr=c["outer-lr"],
            outer_momentum=c["outer-momentum"],
            nesterov=c["nesterov"],
            orthogonalize=c["orthogonalize"],
            weighting=c["weighting"],
            client_sends=c["client-sends"],
            fraction_train=c["fraction-train"],
            fraction_evaluate=c["fraction-evaluate"],
            min_train_nodes=c["min-train-nodes"],
            min_evaluate_nodes=c["min-evaluate-nodes"],
            min_available_nodes=c["min-available-nodes"],
            max_update_norm=c["max-update-norm"] or None,
            max_norm_ratio=c["max-norm-ratio"] or None,
            max_weight_ratio=c["max-weight-ratio"],
            max_empty_rounds=c["max-empty-rounds"],
            dtype_policy=c["dtype-policy"],
            seed=c["seed"],
            upload_codec=c["upload-codec"],
            codec_options=_codec_options(c),
            error_feedback=c["error-feedback"],
        )
        kwargs.update(cls._extra_from_config(c))
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def _extra_from_config(cls, c: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ model bookkeeping
    def _adopt(self, arrays: ArrayRecord) -> None:
        sd = arrays.to_torch_state_dict()
        self._dtypes = {k: v.dtype for k, v in sd.items()}
        self.theta = {
            k: (v.detach().float().clone() if v.is_floating_point() else v.detach().clone())
            for k, v in sd.items()
        }

    def _model_record(self) -> ArrayRecord:
        assert self.theta is not None
        return ArrayRecord({k: v.to(self._dtypes.get(k, v.dtype)) for k, v in self.theta.items()})

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        *args: Any,
        **kwargs: Any,
    ) -> Result:
        """Run rounds ``server_round + 1 .. num_rounds`` (Flower's ``Strategy.start``).

        ``num_rounds`` is the total, as for :class:`~flwr_isoloco.strategies.RWLoRA`: a fresh
        strategy runs all of them, one restored with :meth:`load_state_dict` the remaining ones,
        continuing from its own ``theta`` (its keys must match ``initial_arrays``).
        """
        if self.theta is None:
            self._adopt(initial_arrays)
        elif set(self.theta) != set(initial_arrays.keys()):
            raise ValueError(
                "restored strategy state does not match initial_arrays: keys differ "
                f"(e.g. {sorted(set(self.theta) ^ set(initial_arrays.keys()))[:3]})"
            )
        remaining = num_rounds - self.server_round
        if remaining <= 0:
            log(INFO, "DiLoCo: all %d rounds already done; nothing to run", num_rounds)
            return Result(arrays=self._model_record())
        return super().start(grid, self._model_record(), remaining, *args, **kwargs)

    # ------------------------------------------------------------------ Strategy API
    def summary(self) -> None:
        """Log the configuration, Flower-style."""
        log(INFO, "\t├──> Sampling:")
        log(
            INFO,
            "\t│\t├──Fraction: train (%.2f) | evaluate ( %.2f)",
            self.fraction_train,
            self.fraction_evaluate,
        )
        log(
            INFO,
            "\t│\t├──Minimum nodes: train (%d) | evaluate (%d)",
            self.min_train_nodes,
            self.min_evaluate_nodes,
        )
        log(INFO, "\t│\t└──Minimum available nodes: %d", self.min_available_nodes)
        log(
            INFO,
            "\t├──> Merge: %s %s (%s)",
            self.merge_name,
            self.merge_options,
            self.orthogonalize,
        )
        log(
            INFO,
            "\t├──> Outer SGD: lr %g | momentum %g | nesterov %s",
            self.outer.lr,
            self.outer.momentum,
            self.outer.nesterov,
        )
        log(
            INFO,
            "\t├──> Replies: weighting %s | payload %s | max-update-norm %s | max-norm-ratio %s"
            " | max-weight-ratio %s",
            self.weighting,
            self.client_sends,
            self.train_validator.max_update_norm,
            self.train_validator.max_norm_ratio,
            self.max_weight_ratio or "off",
        )
        log(INFO, "\t├──> Uploads: codec %s %s", self.upload_codec, self.codec_request)
        log(INFO, "\t└──> Keys in records:")
        log(INFO, "\t\t├── Weighted by: '%s'", self.weighted_by_key)
        log(INFO, "\t\t├── ArrayRecord key: '%s'", self.arrayrecord_key)
        log(INFO, "\t\t└── ConfigRecord key: '%s'", self.configrecord_key)

    def _sample(self, grid: Grid, fraction: float, min_nodes: int) -> list[int]:
        connected = list(grid.get_node_ids())
        k = max(int(len(connected) * fraction), min_nodes)
        _, all_nodes = sample_nodes(grid, self.min_available_nodes, k)  # waits for nodes
        k = min(k, len(all_nodes))
        return self._rng.sample(sorted(all_nodes), k)

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
        nodes = self._sample(grid, self.fraction_train, self.min_train_nodes)
        log(INFO, "configure_train: sampled %d nodes", len(nodes))
        config["server-round"] = self.server_round + 1
        for k, v in self.codec_request.items():
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
        agree. Raises :class:`~flwr_isoloco.strategies.common.NoProgressError` only when
        ``max_empty_rounds`` consecutive rounds used no reply.
        """
        t0 = time.perf_counter()
        self.server_round += 1
        if self.theta is None:
            log(WARNING, "aggregate_train: no global model yet (configure_train not called)")
            return None, None
        rule = self._rule_for_g()
        v = self.train_validator
        needs_all = v.max_update_norm or v.max_norm_ratio or self.max_weight_ratio
        if getattr(rule, "streaming", False) and not needs_all:
            report = ReplyReport()  # validate and fold one reply at a time: one decode each
            source: Iterable[CheckedReply] = v.stream(
                replies, self.theta, self._train_ledger, report, log_summary=False
            )
            weights: dict[int, float] | None = None
        else:
            source, report = v.validate(replies, self.theta, self._train_ledger, log_summary=False)
            weights = self._bounded_weights(source)
        checked: list[CheckedReply] = []
        g = self._merge_or_isolate(rule, source, checked, weights, report)
        new_arrays = None
        extra: dict[str, float] = {}
        if g is not None:
            extra["pseudo-grad-norm"] = tensor_norm(g)
            try:
                self._outer_step(g)
                new_arrays = self._model_record()
            except (ValueError, RuntimeError) as exc:
                self._drop_all(checked, report, f"outer step failed, model kept: {exc}")
                checked = []
        report.used = len(checked)
        v.log_summary(report, self.server_round)
        if not checked:
            log(
                WARNING,
                "aggregate_train: no usable reply in round %d, model kept",
                self.server_round,
            )
        if self.train_metrics_aggr_fn is not None and checked:
            client = dict(
                self.train_metrics_aggr_fn([r.content for r in checked], self.weighted_by_key)
            )
        else:
            client = weighted_mean_metrics(checked, exclude=[self.weighted_by_key])
        metrics = {
            **client,
            **report.as_metrics(),
            **extra,
            "bytes-down": self._bytes_down,
            "aggregation-time-s": time.perf_counter() - t0,
        }
        if self._train_ledger.sent_any():
            self._guard.record(self.server_round, report.used, [why for _, why in report.reasons])
        return new_arrays, metric_record(metrics)

    def _bounded_weights(self, replies: list[CheckedReply]) -> dict[int, float]:
        """Merge weight per node: ``w_i`` clipped to ``max_weight_ratio x median`` (logged)."""
        raw = [self._weight(r) for r in replies]
        bounded, clipped = bounded_weights(raw, self.max_weight_ratio)
        for i in clipped:
            log(
                WARNING,
                "aggregate_train: node %d: weight %s=%.4g clipped to %.4g "
                "(max-weight-ratio %g x the round's median)",
                replies[i].node_id,
                self.weighted_by_key,
                raw[i],
                bounded[i],
                self.max_weight_ratio,
            )
        return {r.node_id: w for r, w in zip(replies, bounded, strict=True)}

    def _drop_all(self, replies: list[CheckedReply], report: ReplyReport, reason: str) -> None:
        for r in replies:
            self.train_validator.reject(report, r.node_id, reason)

    def _merge_or_isolate(
        self,
        rule: Any,
        source: Iterable[CheckedReply],
        used: list[CheckedReply],
        weights: Mapping[int, float] | None,
        report: ReplyReport,
    ) -> dict[str, torch.Tensor] | None:
        """``g`` over all usable replies; if that merge fails, drop the replies that fail alone.

        A merge can fail on finite input (e.g. an SVD that does not converge); then each reply
        is merged on its own, those that fail or give non-finite values are dropped and named,
        and the rest are merged again. ``used`` ends up holding exactly the replies in ``g``.
        """
        try:
            return self._merge(rule, source, used, weights)
        except (ValueError, RuntimeError) as exc:
            rest = [] if isinstance(source, list) else list(source)  # finish a streamed validation
            log(WARNING, "aggregate_train: merge failed (%s); checking replies one by one", exc)
        suspects, used[:] = used + rest, []
        for r in suspects:
            try:
                self._merge(rule, [r], [], weights)
                used.append(r)
            except (ValueError, RuntimeError) as exc:
                self.train_validator.reject(report, r.node_id, f"merge fails on this reply: {exc}")
        if not used:
            return None
        kept, used[:] = list(used), []
        try:
            return self._merge(rule, kept, used, weights)
        except (ValueError, RuntimeError) as exc:
            self._drop_all(kept, report, f"merge of the round failed, model kept: {exc}")
            used[:] = []
            return None

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Weighted mean of the valid replies' metrics (bad replies dropped, never raises)."""
        checked, report = self.eval_validator.validate(replies, None, self._eval_ledger)
        if not checked:
            return None
        if self.evaluate_metrics_aggr_fn is not None:
            metrics = dict(
                self.evaluate_metrics_aggr_fn([r.content for r in checked], self.weighted_by_key)
            )
        else:
            metrics = weighted_mean_metrics(checked, exclude=[self.weighted_by_key])
        metrics.update({"replies-used": report.used, "replies-rejected": report.rejected})
        return metric_record(metrics)

    # ------------------------------------------------------------------ maths glue
    def _weight(self, reply: CheckedReply) -> float:
        return 1.0 if self.weighting == "uniform" else reply.weight

    def _round_options(self) -> dict[str, Any]:
        opts = dict(self.merge_options)
        if self.merge_name == "dare" and "seed" not in opts:
            opts["seed"] = self.seed * 1_000_003 + self.server_round
        return opts

    def _rule_for_g(self) -> Any:
        return MERGE_RULES["mean"] if self.orthogonalize == "update" else self.rule

    def _merge(
        self,
        rule: Any,
        source: Iterable[CheckedReply],
        used: list[CheckedReply],
        weights: Mapping[int, float] | None = None,
    ) -> dict[str, torch.Tensor] | None:
        """``g`` over the float entries of the model (non-float entries are never updated).

        Streaming rules fold each reply as it comes (then release its tensors); the others
        collect the M deltas for ``merge()``. Appends the replies used to ``used``.
        ``weights`` (node id -> weight) overrides :meth:`_weight`. Raises ``ValueError`` when
        the rule fails or gives non-finite values.
        """

        def weight(r: CheckedReply) -> float:
            return self._weight(r) if weights is None else weights[r.node_id]

        assert self.theta is not None
        floats = [k for k, t in self.theta.items() if t.is_floating_point()]
        opts = {} if self.orthogonalize == "update" else self._round_options()
        if getattr(rule, "streaming", False):
            merger = StreamingMerger(rule, **opts)
            for r in source:
                d = r.update(self.theta)
                r.release()
                used.append(r)  # before add(): a reply that makes add() fail is a suspect
                merger.add({k: d[k] for k in floats}, weight(r))
            return _finite(merger.result()) if used else None
        deltas = []
        for r in source:
            d = r.update(self.theta)
            r.release()
            deltas.append({k: d[k] for k in floats})
            used.append(r)
        if not used:
            return None
        return _finite(merge(rule, deltas, [weight(r) for r in used], **opts))

    def _outer_step(self, g: Mapping[str, torch.Tensor]) -> None:
        assert self.theta is not None
        params = {k: self.theta[k] for k in g}
        transform = None
        if self.orthogonalize == "update":
            opts = self._round_options()

            def transform(u: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                return merge(self.rule, [u], None, **opts)

        new = self.outer.step(params, g, update_transform=transform)
        self.theta = {**self.theta, **{k: v.float() for k, v in new.items()}}

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """``{"tensors": nested dict of tensors, "meta": JSON-able dict}`` (no pickle needed).

        Holds ``theta`` (fp32 master), model dtypes, the outer optimiser (buffers, steps, hyper
        parameters), ``server_round`` and the sampling RNG. Save with
        ``flwr_isoloco.checkpoint.save_checkpoint(path, sd["tensors"], sd["meta"])``.
        """
        if self.theta is None:
            raise ValueError("state_dict(): no global model yet (start() not called)")
        outer_t, outer_m = _split_state(self.outer.state_dict())
        version, internal, gauss = self._rng.getstate()
        return {
            "tensors": {"theta": {k: v.clone() for k, v in self.theta.items()}, "outer": outer_t},
            "meta": {
                "server_round": self.server_round,
                "dtypes": {k: str(v).replace("torch.", "") for k, v in self._dtypes.items()},
                "outer": outer_m,
                "rng": [version, list(internal), gauss],
                "merge": self.merge_name,
                "merge_options": self.merge_options,
                "orthogonalize": self.orthogonalize,
            },
        }

    @staticmethod
    def _state_spec() -> dict[str, Any]:
        """The fields :meth:`load_state_dict` needs in ``meta`` (types and ranges)."""
        from flwr_isoloco.checkpoint_spec import Field

        number = Field("float", min=0)
        outer = {"lr": number, "momentum": number, "nesterov": Field("bool")}
        return {
            "server_round": Field("int", min=0),
            "dtypes": Field("dict", values=Field("str")),
            "outer": Field("dict", fields={**outer, "steps": Field("int", min=0)}),
            "rng": Field("list", length=3),
            "merge": Field("str"),
            "merge_options": Field("dict", optional=True),
            "orthogonalize": Field("str", optional=True),
        }

    def _check_settings(self, meta: Mapping[str, Any]) -> None:
        """Saved merge rule/options, ``orthogonalize`` and outer hyper-parameters must be ours."""
        import json

        from flwr_isoloco.checkpoint_spec import CheckpointError

        if meta["merge"] != self.merge_name:
            raise CheckpointError(
                f"checkpoint was written with merge {meta.get('merge')!r}, "
                f"this strategy uses {self.merge_name!r}"
            )
        saved = {
            "merge_options": meta.get("merge_options", {}),
            "orthogonalize": meta.get("orthogonalize", self.orthogonalize),
            **{f"outer.{k}": meta["outer"][k] for k in ("lr", "momentum", "nesterov")},
        }
        ours = {
            "merge_options": json.loads(json.dumps(self.merge_options)),
            "orthogonalize": self.orthogonalize,
            "outer.lr": self.outer.lr,
            "outer.momentum": self.outer.momentum,
            "outer.nesterov": self.outer.nesterov,
        }
        for name, value in saved.items():
            if value != ours[name]:
                raise CheckpointError(
                    f"field {name!r} = {value!r} differs from this strategy's {ours[name]!r}; "
                    "a resumed run must use the same settings"
                )

    def load_state_dict(
        self, state: Mapping[str, Any], reference: Mapping[str, Any] | None = None
    ) -> None:
        """Restore :meth:`state_dict` output (tensors and meta may come from a checkpoint).

        Everything is checked before anything is set, and a failure is a
        :class:`~flwr_isoloco.checkpoint.CheckpointError` (a ``ValueError``) naming the field or
        tensor: meta types and ranges; ``theta`` and the outer momentum buffers finite, buffers
        only for ``theta``'s names with ``theta``'s shapes; with ``reference`` (the model's
        state dict, name -> tensor), ``theta`` has its names, shapes and dtypes. The saved merge
        rule, merge options, ``orthogonalize`` and outer ``lr``/``momentum``/``nesterov`` must
        equal this strategy's: a resumed run uses the settings it was built with, so a
        checkpoint that disagrees is refused rather than silently overriding them.
        """
        from flwr_isoloco.checkpoint_spec import CheckpointError, check_fields, check_tensors

        if not isinstance(state, Mapping) or "tensors" not in state or "meta" not in state:
            raise CheckpointError("DiLoCo state must be a dict with 'tensors' and 'meta'")
        tensors, meta = state["tensors"], state["meta"]
        if not isinstance(tensors, Mapping):
            raise CheckpointError("DiLoCo state: 'tensors' must be a dict")
        check_fields(dict(meta) if isinstance(meta, Mapping) else meta, self._state_spec())
        self._check_settings(meta)
        dtypes = {}
        for k, v in meta["dtypes"].items():
            dt = getattr(torch, v, None)
            if not isinstance(dt, torch.dtype):
                raise CheckpointError(f"field 'dtypes.{k}' is {v!r}, not a torch dtype")
            dtypes[k] = dt
        theta = tensors.get("theta")
        check_tensors(theta, None, "theta")  # a group of finite tensors
        if set(theta) != set(dtypes):
            odd = sorted(set(theta) ^ set(dtypes), key=str)[0]
            raise CheckpointError(f"tensor 'theta/{odd}' and field 'dtypes' disagree on names")
        if reference is not None:
            check_tensors(theta, reference, "theta")
            bad = [k for k, t in reference.items() if t.dtype != dtypes[k]]
            if bad:
                raise CheckpointError(
                    f"field 'dtypes.{bad[0]}' is {meta['dtypes'][bad[0]]!r}, the model's is "
                    f"{str(reference[bad[0]].dtype).replace('torch.', '')!r}"
                )
        if self.theta is not None:
            check_tensors(theta, self.theta, "theta")
        outer_t = tensors.get("outer", {})
        buffers = outer_t.get("momentum_buffer", {}) if isinstance(outer_t, Mapping) else None
        check_tensors(buffers, None, "outer/momentum_buffer")
        check_tensors(
            buffers, {k: theta[k] for k in buffers if k in theta}, "outer/momentum_buffer"
        )
        version, internal, gauss = meta["rng"]
        try:
            rng = random.Random()
            rng.setstate((version, tuple(internal), gauss))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"field 'rng' is not a valid generator state ({exc})") from None
        self.outer.load_state_dict(_join_state(outer_t, meta["outer"]))
        # Keep the model's own key order (a checkpoint may sort keys; clients may care).
        self.theta = {k: theta[k].detach().clone() for k in dtypes}
        self._dtypes = dtypes
        self._rng.setstate(rng.getstate())
        self.server_round = meta["server_round"]


class IsoLoCo(DiLoCo):
    """DiLoCo with Iso-C merging: ``g = iso_c(weighted mean)`` on 2-D tensors, mean elsewhere.

    Defaults from the IsoLoCo paper's tuned values: ``outer_lr=1.8``, ``outer_momentum=0.8``,
    Nesterov. ``fast=True`` uses the Newton-Schulz variant ``iso_c_ns`` instead of the SVD.
    """

    RUN_CONFIG_DEFAULTS = {**ISOLOCO_RUN_CONFIG, "fast": False}

    def __init__(
        self,
        *,
        merge: Any = None,
        fast: bool = False,
        outer_lr: float = 1.8,
        outer_momentum: float = 0.8,
        **kwargs: Any,
    ) -> None:
        if merge is None:
            merge = "iso_c_ns" if fast else "iso_c"
        elif fast:
            raise ValueError("give either merge= or fast=True, not both")
        self.fast = fast
        super().__init__(merge=merge, outer_lr=outer_lr, outer_momentum=outer_momentum, **kwargs)

    @classmethod
    def _extra_from_config(cls, c: Mapping[str, Any]) -> dict[str, Any]:
        if c.get("fast"):
            if c["merge"] not in ("iso_c", "iso_c_ns"):
                raise ValueError("strategy.fast=true needs strategy.merge 'iso_c' (the default)")
            return {"merge": None, "fast": True}
        return {}
