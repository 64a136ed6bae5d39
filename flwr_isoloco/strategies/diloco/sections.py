"""DiLoCo's and IsoLoCo's run-config section as constructor arguments: the one mapping from the
validated ``strategy.*`` keys (:mod:`~flwr_isoloco.strategies.diloco.config`: keys, defaults,
value checks) to the arguments and settings objects, and :class:`FromRunConfig`, the
construction from a run config.

Keys whose values only mean something together are checked together here, each error naming
the keys and the fix: a key that would have no effect (``strategy.grace-s`` without a quorum,
``strategy.max-weight-ratio`` under uniform weights, ``strategy.codec-ef-decay`` without an
upload codec, the asynchronous keys of synchronous rounds) is refused, never ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from flwr_isoloco.merging.device import resolve_device
from flwr_isoloco.merging.robust import ROBUST_OPTIONS
from flwr_isoloco.strategies.core.stream import quorum_arg
from flwr_isoloco.strategies.diloco.config import (
    APP_KEYS,
    DILOCO_RUN_CONFIG,
    read_section,
)
from flwr_isoloco.strategies.diloco.settings import (
    DEFAULT_MAX_WEIGHT_RATIO,
    AdaptiveClipping,
    CentralDP,
    Codec,
    Divergence,
    DPSettings,
    LocalDP,
    MergeSettings,
    ReplyChecks,
    Rounds,
    as_robust,
)

__all__ = [
    "FromRunConfig",
    "run_config_defaults",
    "codec_options",
    "section_checks",
    "section_kwargs",
    "section_privacy",
    "section_rounds",
]

_MERGE_OPTION_KEYS = {
    "prune-fraction": "prune_fraction",
    "drop-rate": "drop_rate",
    "common-fraction": "common_fraction",
    "ns-steps": "ns_steps",
    "spectral-pattern": "spectral_pattern",
}


def merge_device_arg(option: Any) -> Any:
    """``strategy.merge-device`` resolved on this (the server's) machine: a ``ValueError``
    naming the key, and the fix, for a CUDA device that is not visible here."""
    try:
        return resolve_device(option)
    except ValueError as exc:
        raise ValueError(
            f"strategy.merge-device: {exc}, or run the ServerApp where a CUDA device is visible"
        ) from None


def codec_options(c: Mapping[str, Any], codec_key: str = "upload-codec") -> dict[str, Any]:
    """The options of the codec named by ``c[codec_key]`` from the flat ``codec-*`` keys of the
    section: only the options that codec takes (sparseloco: chunk, k, bits; int8: block_size,
    ...); an option without a key here takes the codec's default. ``codec-ef-decay`` (-1: the
    codec's default) is the decay of a worker's error feedback, an upload option: a download
    codec never takes it (the server sends its whole residual)."""
    from flwr_isoloco.compression import EXACT, OPTION_KEYS, normalize_options

    if c[codec_key] == EXACT:  # a download mode without options
        return {}
    allowed = normalize_options(c[codec_key])
    opts = {o: c[k] for k, o in OPTION_KEYS.items() if o in allowed and k in c}
    decay = c.get("codec-ef-decay", -1)
    if codec_key == "upload-codec" and "ef_decay" in allowed and decay != -1:
        opts["ef_decay"] = float(decay)
    return opts


def section_codecs(c: Mapping[str, Any]) -> dict[str, Codec | None]:
    """``upload`` and ``download`` from ``upload-codec`` / ``download-codec`` and the
    ``codec-*`` keys; ``ValueError`` naming ``codec-ef-decay`` set without an upload codec."""
    upload, download = c["upload-codec"], c.get("download-codec", "none")
    if upload == "none" and c.get("codec-ef-decay", -1) != -1:
        raise ValueError(
            "strategy.codec-ef-decay is the decay of the workers' error feedback, which needs "
            "an upload codec: set strategy.upload-codec, or leave strategy.codec-ef-decay at -1"
        )
    return dict(
        upload=None
        if upload == "none"
        else Codec(upload, error_feedback=c["error-feedback"], **codec_options(c)),
        download=None
        if download == "none"
        else Codec(
            download,
            nodes_hold_initial=c.get("download-nodes-hold-initial", False),
            **codec_options(c, "download-codec"),
        ),
    )


def section_checks(c: Mapping[str, Any]) -> ReplyChecks:
    """The reply keys as :class:`ReplyChecks`. ``max-weight-ratio`` at its default is
    ``"auto"`` (5 under ``weighting = "examples"``, off under ``"uniform"``); another value
    under uniform weights clips nothing and is refused, naming both keys."""
    ratio = c["max-weight-ratio"]
    if c["weighting"] == "uniform" and ratio not in (0, DEFAULT_MAX_WEIGHT_RATIO):
        raise ValueError(
            f"strategy.max-weight-ratio = {ratio:g} clips weights, but strategy.weighting = "
            "'uniform' gives every reply weight 1: leave strategy.max-weight-ratio at its "
            "default (or 0), or set strategy.weighting = 'examples'"
        )
    return ReplyChecks(
        weighting=c["weighting"],
        payload=c["payload"],
        max_update_norm=c["max-update-norm"] or None,
        max_norm_ratio=c["max-norm-ratio"] or None,
        max_weight_ratio="auto" if ratio == DEFAULT_MAX_WEIGHT_RATIO else ratio,
        dtype_policy=c["dtype-policy"],
    )


def section_kwargs(c: Mapping[str, Any]) -> dict[str, Any]:
    """DiLoCo constructor arguments from a validated section ``c`` (every key present): the one
    mapping from run-config keys to arguments and settings objects.

    Merge options at -1 / "" are left to the rule; norm bounds at 0 are off (None).
    """
    options = {}
    for key, opt in _MERGE_OPTION_KEYS.items():
        v = c[key]
        if (isinstance(v, str) and v != "") or (not isinstance(v, str) and v >= 0):
            options[opt] = v
    return dict(
        merge=c["merge"],
        outer_lr=c["outer-lr"],
        outer_momentum=c["outer-momentum"],
        nesterov=c["nesterov"],
        fraction_train=c["fraction-train"],
        fraction_evaluate=c["fraction-evaluate"],
        min_train_nodes=c["min-train-nodes"],
        min_evaluate_nodes=c["min-evaluate-nodes"],
        min_available_nodes=c["min-available-nodes"],
        seed=c["seed"],
        merge_settings=MergeSettings(
            options=options,
            orthogonalize=c["orthogonalize"],
            device=merge_device_arg(c["merge-device"]),
            buffers=c["buffers"],
        ),
        checks=section_checks(c),
        rounds=section_rounds(c),
        **section_codecs(c),
        divergence=Divergence(c["on-divergence"], c["divergence-factor"]),
        robust=as_robust(c["robust"], robust_options(c)),
        privacy=section_privacy(c),
    )


ASYNC_KEYS = {
    "async-replies-per-step": "replies_per_step",
    "max-staleness": "max_staleness",
    "async-staleness": "staleness",
    "momentum-every": "momentum_every",
    "async-hold": "hold",
}
"""Run-config keys of asynchronous rounds -> :class:`Rounds` fields."""


def section_rounds(c: Mapping[str, Any]) -> Rounds:
    """``quorum`` (:func:`~flwr_isoloco.strategies.core.stream.quorum_arg`), ``grace-s``, ``max-empty-rounds`` and
    the asynchronous keys as :class:`Rounds`; a ``ValueError`` naming the keys that do not go
    together (a section without the asynchronous keys, e.g. an app's older schema, is
    synchronous)."""
    quorum, grace = quorum_arg(c["quorum"]), c["grace-s"]
    if not c.get("asynchronous", False):
        given = [f"strategy.{k}" for k in ASYNC_KEYS if k in c and c[k] != DILOCO_RUN_CONFIG[k]]
        if given:
            raise ValueError(
                f"{', '.join(given)} apply to asynchronous rounds only; set "
                "strategy.asynchronous = true or leave them at their defaults"
            )
        if grace and quorum is None:
            raise ValueError(
                f"strategy.grace-s = {grace:g} is a wait for the rest once a quorum is in, but "
                "strategy.quorum = 1.0 waits for every reply: set strategy.quorum below 1.0 (a "
                "fraction) or to a count >= 2, or leave strategy.grace-s at 0"
            )
        return Rounds(quorum, grace, c["max-empty-rounds"])
    if quorum is not None or grace:
        raise ValueError(
            "strategy.quorum / strategy.grace-s close a synchronous round; with "
            "strategy.asynchronous = true leave them at 1.0 / 0.0 (an outer step takes the first "
            "strategy.async-replies-per-step replies)"
        )
    fields = {f: c[k] for k, f in ASYNC_KEYS.items() if k in c}
    if fields.get("replies_per_step") == 0:
        fields["replies_per_step"] = None  # 0: the number of nodes training
    return Rounds(max_empty_rounds=c["max-empty-rounds"], asynchronous=True, **fields)


def section_privacy(c: Mapping[str, Any]) -> DPSettings | None:
    """The ``dp-*`` keys as :class:`CentralDP` / :class:`LocalDP`; clipping norm 0: DP off (then
    a noise multiplier or max epsilon is refused, as the constructor refused them alone)."""
    z, clip, max_eps = c["dp-noise-multiplier"], c["dp-clipping-norm"], c["dp-max-epsilon"]
    quantile = c["dp-adaptive-quantile"]
    if not clip:
        given = [
            k for k in ("dp-noise-multiplier", "dp-max-epsilon", "dp-adaptive-quantile") if c[k]
        ]
        if given:
            raise ValueError(
                f"strategy.{' and strategy.'.join(given)} {'needs' if len(given) == 1 else 'need'}"
                " strategy.dp-clipping-norm > 0 (the sensitivity C)"
            )
        return None
    common = dict(
        clipping_norm=clip,
        noise_multiplier=z,
        delta=float(c["dp-delta"]),
        max_epsilon=max_eps or None,
    )
    if c["dp-mode"] == "local":
        if quantile:
            raise ValueError("strategy.dp-adaptive-quantile needs strategy.dp-mode 'central'")
        return LocalDP(**common)
    adaptive = None
    if quantile:
        adaptive = AdaptiveClipping(quantile, c["dp-clip-count-std"] or None, c["dp-clip-lr"])
    return CentralDP(**common, adaptive=adaptive)


def robust_options(c: Mapping[str, Any]) -> dict[str, Any]:
    """The chosen robust rule's options from ``robust-trim`` / ``robust-f`` / ``robust-select`` /
    ``robust-factor`` (-1: the rule's default; a key the rule does not take is ignored)."""
    allowed = ROBUST_OPTIONS[c["robust"]]
    keys = {
        "trim": "robust-trim",
        "f": "robust-f",
        "select": "robust-select",
        "factor": "robust-factor",
    }
    return {o: c[k] for o, k in keys.items() if o in allowed and c[k] != -1}


def run_config_defaults(cls: type[FromRunConfig]) -> dict[str, Any]:
    """The run-config keys of strategy class ``cls`` (without the ``strategy.`` prefix) and their
    defaults: DiLoCo's :data:`~.config.DILOCO_RUN_CONFIG`; IsoLoCo's ``ISOLOCO_RUN_CONFIG`` and
    ``fast``."""
    return dict(cls._RUN_CONFIG_DEFAULTS)


class FromRunConfig:
    """Mixin of :class:`~flwr_isoloco.strategies.DiLoCo`: construction from a run config."""

    _RUN_CONFIG_DEFAULTS = DILOCO_RUN_CONFIG  # IsoLoCo: ISOLOCO_RUN_CONFIG and strategy.fast

    @classmethod
    def from_run_config(
        cls,
        run_config: Mapping[str, Any],
        prefix: str = "strategy.",
        ignore: Iterable[str] = APP_KEYS,
        **overrides: Any,
    ) -> Any:
        """From the flat run config (``strategy.<key>``); a bad key: ``ValueError``; overrides last."""
        section = read_section(run_config, cls._RUN_CONFIG_DEFAULTS, prefix, ignore)
        return cls.from_section(section, **overrides)

    @classmethod
    def from_section(cls, section: Mapping[str, Any], **overrides: Any) -> Any:
        """Build from an already validated section (keys without the prefix, defaults filled in)."""
        c = {**cls._RUN_CONFIG_DEFAULTS, **section}
        kwargs = section_kwargs(c)
        kwargs.update(cls._extra_from_config(c))
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def _extra_from_config(cls, c: Mapping[str, Any]) -> dict[str, Any]:
        return {}
