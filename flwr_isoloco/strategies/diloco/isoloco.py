"""IsoLoCo: DiLoCo whose merge rule is Iso-C (flattened spectrum of the weighted mean).

Its update comes by name (``preset``, :data:`flwr_isoloco.strategies.diloco.presets.ISOLOCO_PRESETS`); the maths
is the repository's ``docs/algorithms.md`` ("Algorithms") 3 and 3.1, the choice of defaults the repository's ``docs/strategies.md`` ("DiLoCo / IsoLoCo strategies") "Defaults".
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from logging import WARNING
from typing import Any

from flwr.common.logger import log

from flwr_isoloco.merging.outer import nesterov_step_limit
from flwr_isoloco.settings_tools import renamed_fields
from flwr_isoloco.strategies.diloco.config import ISOLOCO_RUN_CONFIG
from flwr_isoloco.strategies.diloco.diloco import DiLoCo
from flwr_isoloco.strategies.diloco.presets import ISOLOCO_PRESETS, resolve_preset
from flwr_isoloco.strategies.diloco.settings import MergeSettings

__all__ = ["IsoLoCo", "ISOLOCO_PRESETS"]


@renamed_fields(fast="preset='isoloco-paper', merge='iso_c_ns'")
class IsoLoCo(DiLoCo):
    """DiLoCo with Iso-C merging: ``g = rule(weighted mean)`` on 2-D tensors, mean elsewhere.

    With the weighted mean ``m = U diag(s) V^T`` (thin SVD, ``s`` its singular values), the
    ``"dropin"`` rule (``iso_c_matched``) is ``g = U diag(min(t, 2 s)) V^T``, ``t`` the level at
    which ``||g||_F = ||m||_F`` (no direction raised more than 2 x); the ``"isoloco-paper"``
    rule (``iso_c``) is ``g = mean(s) U V^T``. Then DiLoCo's outer step.

    Parameters
    ----------
    preset : "dropin" | "isoloco-paper"
        The rule, ``outer_lr``, ``outer_momentum`` and ``nesterov`` not given: ``"dropin"``:
        ``iso_c_matched``, 0.5, 0.9, Nesterov (stable where local training converges within a
        round); ``"isoloco-paper"``: ``iso_c``, 1.8, 0.8, Nesterov (tuned for LLaMA with
        AdamW; its Newton-Schulz form: ``merge="iso_c_ns"``).
    merge, outer_lr, outer_momentum, nesterov :
        As in :class:`DiLoCo`; ``None``: the preset's (with ``orthogonalize="update"``: iso_c).
    upload : Codec | str | None
        The workers' delta codec: ``"int8"``, ``"fp8"``, ``"int4"``, ``"topk"``,
        ``"sparseloco"`` or a :class:`Codec`; a plain ClientApp needs ``mods=[upload_mod]``.
    download : Codec | str | None
        The model codec down (the change of the nodes' copy ``B``, not ``theta``; nodes need
        ``mods=[download_mod]``); ``"exact"``: the server's step from the sparse uploads.
    **kwargs :
        The other arguments of :class:`DiLoCo`, passed on as given.
    """

    _RUN_CONFIG_DEFAULTS = {**ISOLOCO_RUN_CONFIG, "fast": False}  # fast: merge="iso_c_ns"

    def __init__(
        self,
        *,
        preset: str = "dropin",
        merge: Any = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        nesterov: bool | None = None,
        **kwargs: Any,
    ) -> None:
        p = resolve_preset(preset)
        orthogonalize = kwargs.get("merge_settings", MergeSettings()).orthogonalize
        if merge is None:  # orthogonalize="update" takes the exact-SVD rule's update form
            merge = "iso_c" if orthogonalize == "update" else p.merge
        self.preset = preset
        super().__init__(
            merge=merge,
            outer_lr=p.outer_lr if outer_lr is None else outer_lr,
            outer_momentum=p.outer_momentum if outer_momentum is None else outer_momentum,
            nesterov=p.nesterov if nesterov is None else nesterov,
            **kwargs,
        )
        if preset != "isoloco-paper":  # the paper's values, chosen by name: no second-guessing
            self._warn_if_beyond_limit()

    def _warn_if_beyond_limit(self) -> None:
        """One warning when ``outer_lr`` is stable only for a contraction ``c < 1``."""
        o = self.outer
        limit = nesterov_step_limit(o.momentum, o.nesterov)
        if o.lr > limit:
            log(
                WARNING,
                "IsoLoCo: outer_lr=%g with momentum %g is stable only while local training "
                "moves a node less than %.0f%% of the way to its optimum per round (lr*c < %.3f, "
                "docs/algorithms.md, section 3.1, in the source tree); the paper tuned it for LLaMA + AdamW. Where local "
                "training converges within a round (SGD apps) it diverges: use the default "
                "preset 'dropin'.",
                o.lr,
                o.momentum,
                100 * min(1.0, limit / o.lr),
                limit,
            )

    @classmethod
    def _extra_from_config(cls, c: Mapping[str, Any]) -> dict[str, Any]:
        """``strategy.preset``; ``outer-lr`` / ``outer-momentum`` at -1 take the preset's."""
        extra: dict[str, Any] = {"preset": c.get("preset", "dropin")}
        if c["merge"] == "":
            extra["merge"] = None
        for key, arg in (("outer-lr", "outer_lr"), ("outer-momentum", "outer_momentum")):
            if c[key] == -1:
                extra[arg] = None
        if c.get("fast"):  # iso_c_ns, the Newton-Schulz form of the "isoloco-paper" rule
            if c["merge"] not in ("", "iso_c", "iso_c_ns"):
                raise ValueError("strategy.fast=true needs strategy.merge 'iso_c' (the default)")
            rule = resolve_preset(extra["preset"]).merge
            if rule != "iso_c":  # fast must not change the rule behind one's back
                raise ValueError(
                    f"strategy.fast = true is iso_c_ns, the Newton-Schulz form of iso_c "
                    f"(strategy.preset = 'isoloco-paper'); preset {extra['preset']!r} merges "
                    f"with {rule!r}, which has no Newton-Schulz form: set strategy.preset = "
                    "'isoloco-paper', or strategy.merge = 'iso_c_ns' to take that rule with "
                    "this preset's outer lr and momentum"
                )
            extra["merge"] = "iso_c_ns"
        return extra


def _signature() -> inspect.Signature:
    """IsoLoCo's signature as ``help()`` and IDEs show it: ``preset``, then DiLoCo's
    parameters (``merge`` and the outer optimiser defaulting to None: the preset's), read from
    :class:`DiLoCo` so the two cannot drift apart."""
    own = inspect.signature(IsoLoCo.__init__).parameters
    first = [own["self"], own["preset"]]
    rest = [own.get(n, q) for n, q in inspect.signature(DiLoCo.__init__).parameters.items()]
    return inspect.Signature([*first, *rest[1:]], return_annotation=None)


IsoLoCo.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
