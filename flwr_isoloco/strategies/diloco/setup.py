"""DiLoCo's construction helpers: the merge rule and round merge, the outer optimiser, the
reply validators, the keywords that moved into a settings object (refused, naming it), and
:class:`SettingsViews` with :func:`effective_weighting` and :func:`codec_request`, the strategy's
read-only views of its settings objects.

The argument checks themselves are :func:`~flwr_isoloco.strategies.diloco.config.check_arguments`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr_isoloco.compression import EXACT, request_config
from flwr_isoloco.merging import MERGE_RULES
from flwr_isoloco.merging.buffers import resolve_buffers
from flwr_isoloco.merging.fold import RoundMerge
from flwr_isoloco.merging.outer import OuterSGD
from flwr_isoloco.merging.robust import RobustMerge, resolve_robust
from flwr_isoloco.merging.rules import check_options
from flwr_isoloco.strategies.core.replies import ReplyValidator
from flwr_isoloco.strategies.diloco.dp_settings import finite_number as _is_number
from flwr_isoloco.strategies.diloco.settings import (
    CentralDP,
    Codec,
    DPSettings,
    ReplyChecks,
    Robust,
    Rounds,
)

SPECTRAL_FOR_UPDATE = ("iso_c", "iso_c_ns")
"""The rules that ``orthogonalize="update"`` applies to the outer update."""

RECORD_FIELDS = (
    "weighted_by_key",
    "arrayrecord_key",
    "configrecord_key",
    "train_metrics_aggr_fn",
    "evaluate_metrics_aggr_fn",
)
"""The fields of ``records=Records(...)``, kept by the strategy as attributes of the same name."""
MOVED_TO_MERGE_SETTINGS = {
    "merge_options": "options",
    "orthogonalize": "orthogonalize",
    "merge_device": "device",
    "buffers": "buffers",
}
"""The constructor keywords that are a field of ``merge_settings=MergeSettings(...)`` now."""
MOVED_ARGUMENTS = {
    "asynchronous": "rounds=Rounds.asynchronous",
    **{k: f"merge_settings=MergeSettings.{f}" for k, f in MOVED_TO_MERGE_SETTINGS.items()},
    **{k: f"records=Records.{k}" for k in RECORD_FIELDS},
}
"""Keywords DiLoCo refuses, naming the settings field that took their place
(:func:`~flwr_isoloco.settings_tools.renamed_fields`)."""


def rule_and_name(merge_rule: Any) -> tuple[Any, str]:
    """``(rule, name)`` from a name in ``MERGE_RULES`` or any object with a ``name`` and a
    ``streaming`` (a MergeRule or one of its kind); ``ValueError`` else."""
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


def setup_merge(
    s: Any,
    merge: Any,
    merge_options: Mapping[str, Any] | None,
    orthogonalize: str,
    seed: int,
    robust: Robust | None = None,
) -> None:
    """Set strategy ``s``'s rule, its checked options, the robust aggregation and the round
    merge (on ``s.merge_device``); ``ValueError`` naming a problem."""
    s.rule, s.merge_name = rule_and_name(merge)
    if orthogonalize == "update" and s.merge_name not in SPECTRAL_FOR_UPDATE:
        raise ValueError(
            f"orthogonalize='update' needs merge in {SPECTRAL_FOR_UPDATE}, got {s.merge_name!r}"
        )
    s.merge_options = dict(merge_options or {})
    check_options(s.rule, s.merge_options)  # unknown option / bad value -> ValueError
    rule_for_g = MERGE_RULES["mean"] if orthogonalize == "update" else s.rule
    name, options = ("none", {}) if robust is None else (robust.name, robust.options())
    s.robust, s.robust_options = resolve_robust(name, options, rule_for_g)
    aggregator = None if s.robust == "none" else RobustMerge(s.robust, s.robust_options)
    s.merger = RoundMerge(
        s.rule,
        s.merge_name,
        s.merge_options,
        orthogonalize,
        seed,
        robust=aggregator,
        device=s.merge_device,
    )


def buffer_keys(s: Any) -> frozenset[str]:
    """The float keys of strategy ``s``'s model that are buffers (``s.buffers``,
    :func:`~flwr_isoloco.merging.buffers.resolve_buffers`), resolved once per set of keys."""
    if s.theta is None:
        return frozenset()
    keys = tuple(s.theta)
    cached = s.__dict__.get("_buffer_keys")
    if cached is None or cached[0] != keys or cached[1] is not s.buffers:
        cached = (keys, s.buffers, resolve_buffers(s.buffers, s.theta))
        s.__dict__["_buffer_keys"] = cached
    return cached[2]


def outer_optimizer(outer_lr: Any, outer_momentum: Any, nesterov: Any) -> OuterSGD:
    """The outer SGD; Nesterov only with a momentum ``> 0`` (OuterSGD checks lr / momentum,
    ``ValueError`` naming them)."""
    mu = float(outer_momentum) if _is_number(outer_momentum) else outer_momentum
    return OuterSGD(outer_lr, mu, bool(nesterov) and _is_number(mu) and mu > 0)


def validators(s: Any, checks: ReplyChecks) -> tuple[ReplyValidator, ReplyValidator]:
    """The train validator (arrays, dtype policy, norm bounds; 0 = off) and the evaluate one,
    on strategy ``s``'s record keys and ``checks``' default payload."""
    train = ReplyValidator(
        arrayrecord_key=s.arrayrecord_key,
        weighted_by_key=s.weighted_by_key,
        dtype_policy=checks.dtype_policy,
        max_update_norm=checks.max_update_norm or None,
        max_norm_ratio=checks.max_norm_ratio or None,
        default_payload=checks.payload,
        what="aggregate_train",
    )
    evaluate = ReplyValidator(
        arrayrecord_key=s.arrayrecord_key,
        weighted_by_key=s.weighted_by_key,
        require_arrays=False,
        what="aggregate_evaluate",
    )  # aggregation as the graph strategies' federated evaluation (evaluation.py)
    return train, evaluate


class SettingsViews:
    """What DiLoCo reads of its settings objects (``checks``, ``rounds``, ``upload``,
    ``privacy``), as read-only properties: one source of truth, so a view and its setting can
    never disagree."""

    checks: ReplyChecks
    rounds: Rounds
    upload: Codec | None
    privacy: DPSettings | None

    @property
    def weighting(self) -> str:
        """The weighting configured: ``checks.weighting``."""
        return self.checks.weighting

    @property
    def max_weight_ratio(self) -> float:
        """The weight bound in force: ``checks.weight_ratio``, 0.0 (off) under uniform weights."""
        return 0.0 if effective_weighting(self) == "uniform" else self.checks.weight_ratio

    @property
    def payload(self) -> str:
        """What replies hold by default: ``checks.payload``."""
        return self.checks.payload

    @property
    def quorum(self) -> float | int | None:
        """The quorum that closes a round early (None: all): ``rounds.closing_quorum``."""
        return self.rounds.closing_quorum

    @property
    def grace_s(self) -> float:
        """Seconds to wait for the rest once the quorum is in: ``rounds.grace_s``."""
        return float(self.rounds.grace_s)

    @property
    def upload_codec(self) -> str:
        """The upload codec's name (``"none"``: plain replies)."""
        return "none" if self.upload is None else self.upload.name


def effective_weighting(s: Any) -> str:
    """Strategy ``s``'s weighting in force: ``checks.weighting``, but ``"uniform"`` under central
    DP (its noise is sized for ``w_i = 1``, privacy.py)."""
    return "uniform" if isinstance(s.privacy, CentralDP) else s.checks.weighting


def codec_request(upload: Codec | None) -> dict[str, Any]:
    """The train-config entries asking the workers for the ``upload`` codec (empty: none)."""
    u = upload
    return {} if u is None else request_config(u.name, u.options, u.error_feedback)


def check_codecs(upload: Codec | None, download: Codec | None) -> None:
    """``ValueError`` for a codec option that does nothing in the direction it is given for:
    ``nodes_hold_initial`` on an upload (the initial model goes down), ``ef_decay`` on a
    download (the server's residual is sent whole, compression/broadcast.py: no decay)."""
    if upload is not None and upload.nodes_hold_initial:
        raise ValueError("upload: nodes_hold_initial applies to downloads only")
    if upload is not None and upload.name == EXACT:
        raise ValueError(
            "upload: 'exact' is a download mode (the nodes take the server's step from the "
            "round's uploads); give the uploads a codec such as Codec('sparseloco')"
        )
    if download is not None and "ef_decay" in download.options:
        raise ValueError(
            f"download: ef_decay={download.options['ef_decay']!r} decays a worker's error "
            "feedback, an upload's; the server sends its whole residual with the next "
            "broadcast, so a decay would do nothing: leave ef_decay out of download=Codec(...)"
        )
