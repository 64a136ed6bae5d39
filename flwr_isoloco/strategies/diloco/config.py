"""DiLoCo's and IsoLoCo's run-config section: keys, defaults, checks, constructor arguments.

The strategy owns its section (flat Flower keys ``strategy.<key>``): :data:`DILOCO_RUN_CONFIG`
and :data:`ISOLOCO_RUN_CONFIG` are the defaults (written once, here), :data:`RUN_CONFIG_CHECKS`
the value checks. An app composes the section into its own schema and validates its run config
once (:func:`flwr_isoloco.runconfig.read_run_config`), then builds the strategy from the
validated section with :meth:`DiLoCo.from_section <flwr_isoloco.strategies.DiLoCo.from_section>`;
:meth:`~flwr_isoloco.strategies.DiLoCo.from_run_config` does both for a plain Flower app.

Every ClientApp of a run sees the same run config, strategy section included, and may check it;
:data:`SERVER_ONLY_KEYS` are the keys that name something of the server's machine (the merge's
device), which a node checks for spelling only (:func:`node_view`) and the server resolves
when it builds the strategy (a CUDA device must exist there; the error names the key).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from flwr_isoloco.compression import CODECS
from flwr_isoloco.merging import MERGE_RULES
from flwr_isoloco.merging.buffers import check_buffers_spec
from flwr_isoloco.merging.device import parse_device, resolve_device
from flwr_isoloco.merging.robust import ROBUST_OPTIONS, ROBUST_RULES
from flwr_isoloco.outer import ISOLOCO_PRESETS
from flwr_isoloco.runconfig import choices, in_range, non_negative, positive, read_run_config
from flwr_isoloco.strategies.core.divergence import DEFAULT_DIVERGENCE_FACTOR, DIVERGENCE_MODES
from flwr_isoloco.strategies.core.evaluation import check_count, check_fraction
from flwr_isoloco.strategies.core.replies import PAYLOADS
from flwr_isoloco.strategies.core.rounds import quorum_arg
from flwr_isoloco.strategies.diloco.settings import (
    DEFAULT_MAX_WEIGHT_RATIO,
    DTYPE_POLICIES,
    WEIGHTINGS,
    AdaptiveClipping,
    CentralDP,
    Codec,
    Divergence,
    DPSettings,
    LocalDP,
    ReplyChecks,
    Rounds,
    as_robust,
)

__all__ = [
    "DILOCO_RUN_CONFIG",
    "ISOLOCO_RUN_CONFIG",
    "RUN_CONFIG_CHECKS",
    "SERVER_ONLY_KEYS",
    "FromRunConfig",
    "node_view",
    "read_section",
    "section_kwargs",
]

ORTHOGONALIZE = ("gradient", "update")
APP_KEYS = ("name", "timeout", "round-timeout")
"""``strategy.*`` keys that belong to the app, not to the strategy (ignored here)."""

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
    "download-codec": "none",
    "download-nodes-hold-initial": False,
    "codec-block-size": 256,
    "codec-fraction": 0.01,
    "codec-values": "fp32",
    "codec-min-dims": 2,
    "codec-chunk": 4096,
    "codec-k": 64,
    "codec-bits": 2,
    "codec-ef-decay": -1.0,
    "error-feedback": True,
    "on-divergence": "warn",
    "divergence-factor": DEFAULT_DIVERGENCE_FACTOR,
    "quorum": 1.0,
    "grace-s": 0.0,
    "merge-device": "auto",
    "dp-noise-multiplier": 0.0,
    "dp-clipping-norm": 0.0,
    "dp-delta": 1e-5,
    "dp-max-epsilon": 0.0,
    "dp-mode": "central",
    "dp-adaptive-quantile": 0.0,
    "dp-clip-lr": 0.2,
    "dp-clip-count-std": 0.0,
    "robust": "none",
    "robust-trim": -1.0,
    "robust-f": -1,
    "robust-select": -1,
    "robust-factor": -1.0,
    "buffers": "auto",
    "asynchronous": False,
    "async-buffer": 0,
    "max-staleness": 16,
    "async-staleness": 0.5,
    "momentum-every": 1,
}
"""``quorum``: fraction of the sampled nodes in (0, 1] (1.0 = all) or a count >= 1; ``grace-s``:
seconds to wait for the rest once the quorum is in (strategies/core/rounds.py). ``robust``: the
robust aggregation (merging/robust.py); its options ``robust-trim`` / ``robust-f`` /
``robust-select`` / ``robust-factor`` at -1 take the rule's default. ``dp-*``: central DP (strategies/diloco/privacy.py);
0 for the noise multiplier, clipping norm or max epsilon = off; ``dp-adaptive-quantile`` 0 =
fixed clipping norm, else adaptive clipping with ``dp-clip-lr`` and ``dp-clip-count-std``. ``merge-device``: where the
server merge computes ("auto" | "cpu" | "cuda" | "cuda:<index>", merging/device.py). ``buffers``:
the tensors merged as FedAvg does, outside the outer step ("auto" | "none" | a regex;
merging/buffers.py). ``asynchronous``: asynchronous rounds (strategies/diloco/asynchronous.py),
an outer step per ``async-buffer`` replies (0: the number of nodes training), replies more
than ``max-staleness`` steps old dropped, weights discounted by ``(1 + tau)^-async-staleness``,
the outer momentum moved once every ``momentum-every`` steps (``Rounds``' fields)."""
ISOLOCO_RUN_CONFIG: dict[str, Any] = {
    **DILOCO_RUN_CONFIG,
    "merge": "",  # "": the preset's rule
    "preset": "dropin",  # IsoLoCo's presets (flwr_isoloco.outer.ISOLOCO_PRESETS)
    "outer-lr": -1.0,  # -1: the preset's value
    "outer-momentum": -1.0,
}
_MERGE_OPTION_KEYS = {
    "prune-fraction": "prune_fraction",
    "drop-rate": "drop_rate",
    "common-fraction": "common_fraction",
    "ns-steps": "ns_steps",
    "spectral-pattern": "spectral_pattern",
}


def _off_or_at_least_one(value: float) -> None:
    if value != 0 and not value >= 1:
        raise ValueError("must be >= 1, or 0 for off")


def _preset_or_non_negative(value: float) -> None:
    if value != -1 and not value >= 0:
        raise ValueError("must be >= 0, or -1 for the preset's value (IsoLoCo)")


def _rule_or_preset(value: str) -> None:
    if value != "" and value not in MERGE_RULES:
        raise ValueError(f"must be one of {sorted(MERGE_RULES)}, or '' for the preset's (IsoLoCo)")


def _default_or_trim(value: float) -> None:
    if value != -1 and not 0 <= value < 0.5:
        raise ValueError("must be in [0, 0.5), or -1 for the default (0.25)")


def _default_or_non_negative(value: int) -> None:
    if value != -1 and not value >= 0:
        raise ValueError("must be >= 0, or -1 for the default")


def _default_or_positive(value: int) -> None:
    if value != -1 and not value >= 1:
        raise ValueError("must be >= 1, or -1 for the default")


def _default_or_decay(value: float) -> None:
    if value != -1 and not 0 <= value <= 1:
        raise ValueError("must be in [0, 1], or -1 for the codec's default")


def _default_or_factor(value: float) -> None:
    if value != -1 and not 1 <= value < math.inf:
        raise ValueError("must be a finite number >= 1, or -1 for the default (2.0)")


SERVER_ONLY_KEYS: dict[str, Any] = {"merge-device": "cpu"}
"""Keys that name the server's hardware, with a value that resolves on any machine: what a node
checks instead (:func:`node_view`), after the spelling check of :data:`RUN_CONFIG_CHECKS`."""


def node_view(section: Mapping[str, Any]) -> dict[str, Any]:
    """``section`` as a node checks it: :data:`SERVER_ONLY_KEYS` replaced by values that resolve
    anywhere, so a server-only setting (``merge-device = "cuda"`` for a GPU server) never fails
    on a GPU-less node. Their spelling was checked by :data:`RUN_CONFIG_CHECKS` before."""
    return {**section, **{k: v for k, v in SERVER_ONLY_KEYS.items() if k in section}}


def merge_device_arg(option: Any) -> Any:
    """``strategy.merge-device`` resolved on this (the server's) machine: a ``ValueError``
    naming the key, and the fix, for a CUDA device that is not visible here."""
    try:
        return resolve_device(option)
    except ValueError as exc:
        raise ValueError(
            f"strategy.merge-device: {exc}, or run the ServerApp where a CUDA device is visible"
        ) from None


RUN_CONFIG_CHECKS: dict[str, Any] = {
    "merge": _rule_or_preset,
    "preset": choices(*ISOLOCO_PRESETS),
    "outer-lr": _preset_or_non_negative,
    "outer-momentum": _preset_or_non_negative,
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
    "dtype-policy": choices(*DTYPE_POLICIES),
    "upload-codec": choices(*CODECS),
    "download-codec": choices(*CODECS),
    "codec-values": choices("fp32", "int8"),
    "codec-block-size": in_range(1, 1 << 20),
    "codec-min-dims": in_range(0, 8),
    "codec-fraction": in_range(0, 1, lo_open=True),
    "codec-chunk": in_range(4, 1 << 20),  # a square: checked by the codec (Codec(...))
    "codec-k": in_range(1, 1 << 20),  # <= chunk: checked by the codec
    "codec-bits": choices(2, 4),
    "codec-ef-decay": _default_or_decay,
    "on-divergence": choices(*DIVERGENCE_MODES),
    "divergence-factor": _off_or_at_least_one,
    "quorum": in_range(0, 1 << 31, lo_open=True),
    "grace-s": non_negative,
    "merge-device": parse_device,  # spelling here; the server resolves it (merge_device_arg)
    "dp-noise-multiplier": non_negative,
    "dp-clipping-norm": non_negative,
    "dp-delta": in_range(0, 1, lo_open=True, hi_open=True),
    "dp-max-epsilon": non_negative,
    "dp-mode": choices("central", "local"),
    "dp-adaptive-quantile": in_range(0, 1, hi_open=True),
    "dp-clip-lr": positive,
    "dp-clip-count-std": non_negative,
    "robust": choices(*ROBUST_RULES),
    "robust-trim": _default_or_trim,
    "robust-f": _default_or_non_negative,
    "robust-select": _default_or_positive,
    "robust-factor": _default_or_factor,
    "buffers": check_buffers_spec,
    "async-buffer": non_negative,
    "max-staleness": non_negative,
    "async-staleness": non_negative,
    "momentum-every": positive,
}
"""Value checks per key (types come from the defaults); merge options are checked by the rule."""


def codec_options(c: Mapping[str, Any], codec_key: str = "upload-codec") -> dict[str, Any]:
    """The options of the codec named by ``c[codec_key]`` from the flat ``codec-*`` keys of the
    section: only the options that codec takes (sparseloco: chunk, k, bits; int8: block_size,
    ...); an option without a key here takes the codec's default, as does ``codec-ef-decay``
    at -1."""
    from flwr_isoloco.compression import OPTION_KEYS, normalize_options

    allowed = normalize_options(c[codec_key])
    opts = {o: c[k] for k, o in OPTION_KEYS.items() if o in allowed and k in c}
    decay = c.get("codec-ef-decay", -1)
    if "ef_decay" in allowed and decay != -1:
        opts["ef_decay"] = float(decay)
    return opts


def read_section(
    run_config: Mapping[str, Any],
    defaults: Mapping[str, Any],
    prefix: str = "strategy.",
    ignore: Iterable[str] = APP_KEYS,
) -> dict[str, Any]:
    """The validated section (keys without ``prefix``, defaults filled in) of a flat run config.

    Keys outside ``prefix`` and ``prefix + k`` for ``k`` in ``ignore`` are skipped. An unknown
    key, a value of the wrong type or out of range raises ``ValueError`` naming the full key.
    """
    skip = {prefix + k for k in ignore}
    mine = {k: v for k, v in run_config.items() if k.startswith(prefix) and k not in skip}
    parts = [p for p in prefix.split(".") if p]
    schema: dict[str, Any] = dict(defaults)  # nested under the prefix: errors name the full key
    for part in reversed(parts):
        schema = {part: schema}
    checks = {prefix + k: v for k, v in RUN_CONFIG_CHECKS.items() if k in defaults}
    cfg = read_run_config(mine, schema, checks)
    for part in parts:
        cfg = cfg[part]
    return {k: cfg[k] for k in defaults}


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
    upload, download = c["upload-codec"], c.get("download-codec", "none")
    return dict(
        merge=c["merge"],
        merge_options=options,
        outer_lr=c["outer-lr"],
        outer_momentum=c["outer-momentum"],
        nesterov=c["nesterov"],
        orthogonalize=c["orthogonalize"],
        fraction_train=c["fraction-train"],
        fraction_evaluate=c["fraction-evaluate"],
        min_train_nodes=c["min-train-nodes"],
        min_evaluate_nodes=c["min-evaluate-nodes"],
        min_available_nodes=c["min-available-nodes"],
        seed=c["seed"],
        merge_device=merge_device_arg(c["merge-device"]),
        buffers=c["buffers"],
        checks=ReplyChecks(
            weighting=c["weighting"],
            client_sends=c["client-sends"],
            max_update_norm=c["max-update-norm"] or None,
            max_norm_ratio=c["max-norm-ratio"] or None,
            max_weight_ratio=c["max-weight-ratio"],
            dtype_policy=c["dtype-policy"],
        ),
        rounds=section_rounds(c),
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
        divergence=Divergence(c["on-divergence"], c["divergence-factor"]),
        robust=as_robust(c["robust"], robust_options(c)),
        privacy=section_privacy(c),
    )


ASYNC_KEYS = {
    "async-buffer": "buffer",
    "max-staleness": "max_staleness",
    "async-staleness": "staleness",
    "momentum-every": "momentum_every",
}
"""Run-config keys of asynchronous rounds -> :class:`Rounds` fields."""


def section_rounds(c: Mapping[str, Any]) -> Rounds:
    """``quorum``, ``grace-s``, ``max-empty-rounds`` and the asynchronous keys as :class:`Rounds`;
    a ``ValueError`` naming the keys that do not go together (a section without the
    asynchronous keys, e.g. an app's older schema, is synchronous)."""
    quorum, grace = quorum_arg(c["quorum"]), c["grace-s"]
    if not c.get("asynchronous", False):
        given = [f"strategy.{k}" for k in ASYNC_KEYS if k in c and c[k] != DILOCO_RUN_CONFIG[k]]
        if given:
            raise ValueError(
                f"{', '.join(given)} apply to asynchronous rounds only; set "
                "strategy.asynchronous = true or leave them at their defaults"
            )
        return Rounds(quorum, grace, c["max-empty-rounds"])
    if quorum is not None or grace:
        raise ValueError(
            "strategy.quorum / strategy.grace-s close a synchronous round; with "
            "strategy.asynchronous = true leave them at 1.0 / 0.0 (an outer step takes the first "
            "strategy.async-buffer replies)"
        )
    fields = {f: c[k] for k, f in ASYNC_KEYS.items() if k in c}
    if fields.get("buffer") == 0:
        fields["buffer"] = None  # 0: the number of nodes training
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


SETTINGS_TYPES = {
    "checks": (ReplyChecks,),
    "rounds": (Rounds,),
    "divergence": (Divergence,),
    "privacy": (CentralDP, LocalDP, type(None)),
}
"""The settings arguments that take exactly one kind of object (``upload`` and ``robust`` also
take a name)."""


def check_arguments(**args: Any) -> None:
    """``ValueError`` naming the first constructor argument out of its range, choices or type
    (the settings objects checked their own fields when built)."""
    for name in ("fraction_train", "fraction_evaluate"):
        check_fraction(name, args[name])
    for name in ("min_train_nodes", "min_evaluate_nodes", "min_available_nodes"):
        check_count(name, args[name])
    if args["orthogonalize"] not in ORTHOGONALIZE:
        raise ValueError(
            f"orthogonalize must be one of {ORTHOGONALIZE}, got {args['orthogonalize']!r}"
        )
    seed = args["seed"]
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    for name, types in SETTINGS_TYPES.items():
        if not isinstance(args[name], types):
            want = " or ".join("None" if t is type(None) else t.__name__ for t in types)
            raise ValueError(f"{name} must be a {want}, got {args[name]!r}")


class FromRunConfig:
    """Mixin of :class:`~flwr_isoloco.strategies.DiLoCo`: construction from a run config."""

    RUN_CONFIG_DEFAULTS = DILOCO_RUN_CONFIG

    @classmethod
    def from_run_config(
        cls,
        run_config: Mapping[str, Any],
        prefix: str = "strategy.",
        ignore: Iterable[str] = APP_KEYS,
        **overrides: Any,
    ) -> Any:
        """Build from Flower's flat run config (keys ``strategy.<key>``, see ``RUN_CONFIG_DEFAULTS``).

        Keys outside ``prefix`` are ignored, as are ``prefix + k`` for ``k`` in ``ignore`` (the
        app's own keys such as ``strategy.name``). An unknown ``strategy.*`` key, a value of the
        wrong type, an unknown merge rule or a negative lr raise ``ValueError`` naming it.
        ``overrides`` are constructor arguments applied last.
        """
        section = read_section(run_config, cls.RUN_CONFIG_DEFAULTS, prefix, ignore)
        return cls.from_section(section, **overrides)

    @classmethod
    def from_section(cls, section: Mapping[str, Any], **overrides: Any) -> Any:
        """Build from an already validated section (keys of ``RUN_CONFIG_DEFAULTS`` without the
        prefix; missing keys take their defaults), e.g. the ``strategy`` part of an app's
        schema checked with :data:`~flwr_isoloco.strategies.diloco.config.RUN_CONFIG_CHECKS`."""
        c = {**cls.RUN_CONFIG_DEFAULTS, **section}
        kwargs = section_kwargs(c)
        kwargs.update(cls._extra_from_config(c))
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def _extra_from_config(cls, c: Mapping[str, Any]) -> dict[str, Any]:
        return {}
