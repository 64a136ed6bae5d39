"""Setting up asynchronous rounds (:mod:`.asynchronous`, ``Rounds(asynchronous=True)``): the
refusals of what does not compose, the delayed outer momentum, and the checkpoint fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from flwr_isoloco.merging.outer import OuterSGD
from flwr_isoloco.strategies.diloco.asynchronous import AsyncRounds, StrategyOps
from flwr_isoloco.strategies.diloco.composition import refusal
from flwr_isoloco.strategies.diloco.settings import Rounds

__all__ = [
    "asynchronous_rounds",
    "check_composition",
    "parse_checkpoint",
    "state_spec",
]


def check_composition(s: Any, fraction_evaluate: float, fraction_train: float) -> None:
    """Refuse, with the reason, what asynchronous rounds do not compose with (the sentences of
    :mod:`.composition`)."""
    why = None
    privacy = getattr(s, "privacy", None)
    if privacy is not None:
        col = "local-dp" if privacy.mode == "local" else "central-dp"
        why = f"{type(privacy).__name__}: {refusal('asynchronous', col)}"
    elif getattr(s, "download", None) is not None:
        why = refusal("asynchronous", "download")
    elif fraction_train == 0:
        why = "fraction_train=0 trains nothing"
    if why is not None:
        raise ValueError(f"asynchronous rounds: {why}")


def asynchronous_rounds(s: Any, rounds: Rounds, ops: StrategyOps) -> AsyncRounds | None:
    """Strategy ``s``'s asynchronous round driver (None for synchronous rounds), working
    through ``ops``; refuses what does not compose and gives ``s`` the delayed outer momentum
    (``Rounds.momentum_every``)."""
    if not rounds.asynchronous:
        return None
    check_composition(s, s.fraction_evaluate, s.fraction_train)
    o = s.outer
    s.outer = OuterSGD(o.lr, o.momentum, o.nesterov, delay=rounds.momentum_every)
    return AsyncRounds(rounds, ops)


def state_spec() -> Any:
    """The checkpoint meta field ``async``."""
    from flwr_isoloco.checkpoint.spec import Field

    task = Field("list", length=2, items=Field("int", min=0))
    return Field(
        "dict",
        optional=True,
        fields={
            "buffer": Field("int", min=1, nullable=True),  # K: Rounds.replies_per_step
            "max_staleness": Field("int", min=0),
            "staleness": Field("float", min=0),
            "momentum_every": Field("int", min=1),
            "nodes": Field("int", min=0),
            "tasks": Field("list", items=task),
        },
    )


def _parse(
    driver: AsyncRounds,
    meta: Mapping[str, Any] | None,
    tensors: Any,
    theta: Mapping[str, torch.Tensor],
    current: int,
) -> tuple[dict[int, dict[str, torch.Tensor]], list[tuple[int, int]], int, int | None]:
    """Check a checkpoint's asynchronous state against this strategy; ``(versions, plan,
    nodes, K)`` (K: the field ``buffer``, ``Rounds.replies_per_step`` as resolved). ``ValueError``
    naming the field or tensor."""
    from flwr_isoloco.checkpoint.spec import check_tensors

    if meta is None:
        raise ValueError(
            "the checkpoint was written by synchronous rounds; resume it with asynchronous=False"
        )
    ours = driver.settings_meta()
    for key, value in ours.items():
        if key == "buffer" and driver.settings.replies_per_step is None:
            continue  # resolved from the nodes: the checkpoint's value is kept
        if meta[key] != value:
            field = "replies_per_step" if key == "buffer" else key
            raise ValueError(
                f"field 'async.{key}' = {meta[key]!r} differs from this strategy's "
                f"{value!r} (Rounds.{field}); a resumed run must use the same settings"
            )
    tensors = {} if tensors is None else tensors
    if not isinstance(tensors, Mapping):
        raise ValueError("tensor group 'versions' is not a group of tensors")
    versions: dict[int, dict[str, torch.Tensor]] = {}
    low = current - meta["max_staleness"]
    for name, model in tensors.items():
        if not str(name).isdigit() or not low <= int(name) < current:
            raise ValueError(f"tensor group 'versions/{name}' is not a kept version")
        check_tensors(model, theta, f"versions/{name}")
        versions[int(name)] = {k: model[k].detach().clone() for k in theta}
    plan = [(int(n), int(v)) for n, v in meta["tasks"]]
    return versions, plan, meta["nodes"], meta["buffer"]


def parse_checkpoint(s: Any, state: Any) -> tuple[Any, ...] | None:
    """Strategy ``s``'s asynchronous state in checkpoint ``state``, checked before anything is
    set (:meth:`AsyncRounds.parse`; :meth:`AsyncRounds.restore` takes the result); None for
    synchronous rounds, or when the base checks will refuse the checkpoint anyway.
    :class:`~flwr_isoloco.checkpoint.spec.CheckpointError` when the modes or settings differ."""
    from flwr_isoloco.checkpoint.spec import CheckpointError, check_fields

    meta = state.get("meta") if isinstance(state, Mapping) else None
    tensors = state.get("tensors") if isinstance(state, Mapping) else None
    saved = isinstance(meta, dict) and "async" in meta
    if s.async_rounds is None:
        if saved:
            raise CheckpointError(
                "the checkpoint was written by asynchronous rounds; resume it with "
                "Rounds(asynchronous=True) and the same settings"
            )
        return None
    theta = tensors.get("theta") if isinstance(tensors, Mapping) else None
    current = meta.get("server_round") if isinstance(meta, dict) else None
    if not isinstance(theta, Mapping) or not isinstance(current, int):
        return None
    check_fields(meta, {"async": state_spec()})
    try:
        return _parse(s.async_rounds, meta.get("async"), tensors.get("versions"), theta, current)
    except ValueError as exc:
        raise CheckpointError(f"asynchronous rounds: {exc}") from None
