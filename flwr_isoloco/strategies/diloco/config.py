"""DiLoCo's and IsoLoCo's run-config section: keys, defaults, value checks, and the checks of the
constructor's plain arguments.

The strategy owns its section (flat Flower keys ``strategy.<key>``): :data:`DILOCO_RUN_CONFIG`
and :data:`ISOLOCO_RUN_CONFIG` are the defaults (written once, here), :data:`RUN_CONFIG_CHECKS`
the value checks. An app composes the section into its own schema and validates its run config
once (:func:`flwr_isoloco.runconfig.read_run_config`), then builds the strategy from the
validated section with :meth:`DiLoCo.from_section <flwr_isoloco.strategies.DiLoCo.from_section>`;
:meth:`~flwr_isoloco.strategies.DiLoCo.from_run_config` does both for a plain Flower app. The
mapping from keys to constructor arguments is :mod:`~flwr_isoloco.strategies.diloco.sections`.

Every ClientApp of a run sees the same run config, strategy section included, and may check it;
:data:`SERVER_ONLY_KEYS` are the keys that name something of the server's machine (the merge's
device), which a node checks for spelling only (:func:`node_view`) and the server resolves
when it builds the strategy (a CUDA device must exist there; the error names the key).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from flwr_isoloco.compression import CODECS, EXACT
from flwr_isoloco.merging import MERGE_RULES
from flwr_isoloco.merging.buffers import check_buffers_spec
from flwr_isoloco.merging.device import parse_device
from flwr_isoloco.merging.robust import ROBUST_RULES
from flwr_isoloco.runconfig import (
    RunConfigError,
    choices,
    in_range,
    non_negative,
    positive,
    read_run_config,
)
from flwr_isoloco.strategies.core.divergence import DEFAULT_DIVERGENCE_FACTOR, DIVERGENCE_MODES
from flwr_isoloco.strategies.core.evaluation import check_count, check_fraction
from flwr_isoloco.strategies.core.replies import PAYLOADS
from flwr_isoloco.strategies.diloco.presets import ISOLOCO_PRESETS
from flwr_isoloco.strategies.diloco.settings import (
    DEFAULT_MAX_WEIGHT_RATIO,
    DTYPE_POLICIES,
    WEIGHTINGS,
    CentralDP,
    Divergence,
    LocalDP,
    ReplyChecks,
    Rounds,
)
from flwr_isoloco.strategies.diloco.settings_groups import ORTHOGONALIZE, MergeSettings, Records

__all__ = [
    "DILOCO_RUN_CONFIG",
    "ISOLOCO_RUN_CONFIG",
    "RUN_CONFIG_CHECKS",
    "SERVER_ONLY_KEYS",
    "node_view",
    "read_section",
    "refuse_renamed_keys",
]

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
    "payload": "weights",
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
    "async-replies-per-step": 0,
    "max-staleness": 16,
    "async-staleness": 0.5,
    "momentum-every": 1,
    "async-hold": 0.25,
}
"""``quorum``: a fraction of the sampled nodes in (0, 1] (1.0, or 1 in TOML: all) or a whole
count >= 2 (:func:`~flwr_isoloco.strategies.core.stream.quorum_arg`); ``grace-s``: seconds to wait for the rest once the quorum
is in (strategies/core/stream.py; needs a quorum below all). ``robust``: the
robust aggregation (merging/robust.py); its options ``robust-trim`` / ``robust-f`` /
``robust-select`` / ``robust-factor`` at -1 take the rule's default. ``dp-*``: central DP (strategies/diloco/privacy.py);
0 for the noise multiplier, clipping norm or max epsilon = off; ``dp-adaptive-quantile`` 0 =
fixed clipping norm, else adaptive clipping with ``dp-clip-lr`` and ``dp-clip-count-std``. ``merge-device``: where the
server merge computes ("auto" | "cpu" | "cuda" | "cuda:<index>", merging/device.py). ``buffers``:
the tensors merged as FedAvg does, outside the outer step ("auto" | "none" | a regex;
merging/buffers.py). ``asynchronous``: asynchronous rounds (strategies/diloco/asynchronous.py),
an outer step per ``async-replies-per-step`` replies (0: the number of nodes training), replies
more than ``max-staleness`` steps old dropped, weights discounted by
``(1 + tau)^-async-staleness``, the outer momentum moved once every ``momentum-every`` steps, a
node held for the step's model up to ``async-hold`` x its task time (``Rounds``' fields)."""
ISOLOCO_RUN_CONFIG: dict[str, Any] = {
    **DILOCO_RUN_CONFIG,
    "merge": "",  # "": the preset's rule
    "preset": "dropin",  # IsoLoCo's presets (flwr_isoloco.strategies.diloco.presets.ISOLOCO_PRESETS)
    "outer-lr": -1.0,  # -1: the preset's value
    "outer-momentum": -1.0,
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


def _fraction_or_count(value: float) -> None:
    if not (0 < value <= 1 or (value >= 2 and float(value).is_integer())):
        raise ValueError("must be a fraction in (0, 1] (1.0: all) or a whole count >= 2")


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
    "payload": choices(*PAYLOADS),
    "dtype-policy": choices(*DTYPE_POLICIES),
    "upload-codec": choices(*CODECS),
    "download-codec": choices(*CODECS, EXACT),
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
    "quorum": _fraction_or_count,
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
    "async-replies-per-step": non_negative,
    "max-staleness": non_negative,
    "async-staleness": non_negative,
    "momentum-every": positive,
    "async-hold": non_negative,
}
"""Value checks per key (types come from the defaults); merge options are checked by the rule."""


RENAMED_KEYS = {"client-sends": "payload", "async-buffer": "async-replies-per-step"}
"""Section keys that have another name now (old -> new): refused, naming the new one."""


def refuse_renamed_keys(keys: Iterable[str], prefix: str = "strategy.") -> None:
    """:class:`~flwr_isoloco.runconfig.RunConfigError` (a ``ValueError``) naming the new key
    for a key of ``keys`` that :data:`RENAMED_KEYS` renamed (an app's own schema would only
    call it unknown)."""
    keys = set(keys)
    for old, new in RENAMED_KEYS.items():
        if prefix + old in keys:
            raise RunConfigError(f"run-config key {prefix + old!r} is now {prefix + new!r}")


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
    refuse_renamed_keys(mine, prefix)
    parts = [p for p in prefix.split(".") if p]
    schema: dict[str, Any] = dict(defaults)  # nested under the prefix: errors name the full key
    for part in reversed(parts):
        schema = {part: schema}
    checks = {prefix + k: v for k, v in RUN_CONFIG_CHECKS.items() if k in defaults}
    cfg = read_run_config(mine, schema, checks)
    for part in parts:
        cfg = cfg[part]
    return {k: cfg[k] for k in defaults}


SETTINGS_TYPES = {
    "checks": (ReplyChecks,),
    "rounds": (Rounds,),
    "divergence": (Divergence,),
    "merge_settings": (MergeSettings,),
    "records": (Records,),
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
    seed = args["seed"]
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    for name, types in SETTINGS_TYPES.items():
        if not isinstance(args[name], types):
            want = " or ".join("None" if t is type(None) else t.__name__ for t in types)
            raise ValueError(f"{name} must be a {want}, got {args[name]!r}")
