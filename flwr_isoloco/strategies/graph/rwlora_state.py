"""RW-LoRA's checkpoint state: ``state_dict``, its checks and its restoration (no pickle).

``{"tensors": {"token", "optimizer"[, "momentum", "average"]}, "meta": JSON-able}`` (the
variants' groups only when in use, :mod:`.rwlora_variants`): the walk (position, generator),
the trajectory, this round's re-route exclusions, failure counts and log, local updates,
bytes, recent update norms, dead-vertex health, relays, the empty-round streak and the carried
optimiser scalars. :meth:`GraphStrategy.load_state_dict` checks the shared fields; the
RW-LoRA ones are checked in :meth:`RWLoRAState._check_state_tensors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from flwr_isoloco.strategies.core.wire import (
    _config_from_json,
    _config_to_json,
    _record_of,
    record_tensors,
)

__all__ = ["RWLoRAState"]


class RWLoRAState:
    """Mixin of :class:`~flwr_isoloco.strategies.RWLoRA` holding its checkpoint methods."""

    def state_dict(self) -> dict[str, Any]:
        """``{"tensors": {"token", "optimizer"}, "meta": JSON-able}``: pass ``tensors`` and
        ``meta`` to :func:`flwr_isoloco.checkpoint.save_checkpoint` as they are."""
        if self.walk is None:
            raise ValueError("rwlora: state_dict() before the walk was set up (call start first)")
        return {
            "tensors": {
                "token": record_tensors(self.token),
                "optimizer": record_tensors(self.optimizer_state),
                **self._variant_state(),
            },
            "meta": {
                "kind": self.what,
                "round": self.round,
                "vertices": self.vertices,
                "walk": self.walk.state_dict(),
                "trajectory": list(self.trajectory),
                "excluded": list(self.excluded),
                **self._ledger_meta(),
                "update_norms": list(self.update_norms),
                "health": self.health.state_dict(),
                "relays": self.relays,
                "empty_streak": self.guard.streak,
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
        from flwr_isoloco.checkpoint.spec import CheckpointError, Field, check_fields, check_tensors

        check_fields(
            dict(meta),
            {
                "walk": Field("dict"),
                "trajectory": Field("list"),
                "excluded": Field("list"),
                "update_norms": Field("list", items=Field("float", min=0)),
                "optimizer_config": Field("dict", nullable=True, optional=True),
                "health": Field(
                    "dict",
                    optional=True,
                    fields=dict.fromkeys(
                        ("streak", "strikes", "dead_until"),
                        Field("list", items=Field("list", length=2)),
                    ),
                ),
                "relays": Field("int", min=0, optional=True),
            },
        )
        token = tensors.get("token")
        check_tensors(token, reference, "token")
        if not token:
            raise CheckpointError("tensor group 'token' is empty")
        for group in ("momentum", "average"):  # the variants' adapters: the token's names
            if tensors.get(group):
                check_tensors(tensors[group], reference or token, group)
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
        self._load_variant_state(tensors)
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
        self._load_ledger(meta)
        self.update_norms = [float(x) for x in meta["update_norms"]]
        if "health" in meta:  # absent in checkpoints written before dead-vertex handling
            self.health.load_state_dict(meta["health"], self.vertices)
        self.relays = int(meta.get("relays", 0))
        self.guard.streak = int(meta.get("empty_streak", 0))
