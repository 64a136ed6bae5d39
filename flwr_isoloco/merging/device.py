"""Which device computes: :func:`resolve_device` (the server merge, a node's training);
out-of-memory errors told apart.

The merge moves each tensor's M worker slices to the device, merges there and brings the result
back to the CPU, so only one tensor's slices (and its temporaries) live on the device at a time.
``"auto"`` (the default) uses CUDA where ``torch.cuda.is_available()``, else the CPU; results on
the CPU are the same code path, bit for bit, whichever of ``None``, ``"auto"`` or ``"cpu"`` led
there. A node's training resolves its ``train.device`` with the same function
(:func:`resolve_node_device`): in a Ray simulation an actor given
``client-resources-num-gpus > 0`` (``--federation-config``) sees its GPU(s) through
``CUDA_VISIBLE_DEVICES`` (so ``cuda`` is the GPU Ray assigned), one given none sees none.

Out of memory is the server's problem, not the replies': :func:`is_out_of_memory` tells such an
error (``torch.OutOfMemoryError``, a ``RuntimeError`` is its base) from one caused by the data
(a bad delta, an SVD that does not converge), so a round merge can retry on the CPU instead of
rejecting every reply, and raise :class:`MergeOutOfMemoryError` (not a ``RuntimeError``: no
caller mistakes it for a bad reply) when the CPU runs out too. :func:`on_device_or_cpu` is that
retry, for the round merge and for the transform of the outer update
(``orthogonalize="update"``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = [
    "DEVICE_CHOICES",
    "NODE_DEVICE_FIX",
    "MergeOutOfMemoryError",
    "is_out_of_memory",
    "on_device_or_cpu",
    "parse_device",
    "resolve_device",
    "resolve_node_device",
]

_log = logging.getLogger("flwr")  # Flower's logger, by name (this module imports no Flower)
T = TypeVar("T")

#: Spellings :func:`resolve_device` accepts besides a ``torch.device``.
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:<index>")

#: What to do when a node is asked to train on a CUDA device it cannot see.
NODE_DEVICE_FIX = (
    "in a simulation give each node a GPU: flwr run ... --federation-config "
    '"client-resources-num-gpus=1" (or 0.5 to share one GPU between two nodes; sharing does '
    "not cap their memory); "
    "in deployment check CUDA_VISIBLE_DEVICES of the process that runs the ClientApp; "
    "or use 'auto' or 'cpu'"
)


def parse_device(
    option: str | torch.device | None, what: str = "merge device"
) -> torch.device | None:
    """The device ``option`` names (None for ``None`` / ``"auto"``), not checked to exist.

    Raises ``ValueError`` naming the option (``what``, e.g. ``"train.device"``) for a spelling
    that is not a CPU or CUDA device (a run-config pre-check, made where the devices that will
    run it may not be visible).
    """
    if option is None or (isinstance(option, str) and option.strip().lower() == "auto"):
        return None
    if isinstance(option, str):
        try:
            dev = torch.device(option.strip().lower())
        except (RuntimeError, ValueError):
            dev = None
    elif isinstance(option, torch.device):
        dev = option
    else:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{what} {option!r} is not one of {', '.join(DEVICE_CHOICES)} (or a torch.device)"
        )
    return dev


def resolve_device(
    option: str | torch.device | None = "auto",
    *,
    what: str = "merge device",
    fix: str = "use 'auto' or 'cpu'",
) -> torch.device:
    """The ``torch.device`` for a ``device`` option.

    ``None`` or ``"auto"``: ``cuda`` (the current CUDA device) where ``torch.cuda.is_available()``,
    else ``cpu``. ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``: that device, checked
    to exist. Raises ``ValueError`` naming the option (``what``) and, when CUDA is asked for but
    not there, the ``fix``, for anything else (unknown spelling, CUDA asked for but not
    available, index out of range).
    """
    dev = parse_device(option, what)
    if dev is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{what} {option!r}: no CUDA device is visible here "
                f"(torch.cuda.is_available() is False); {fix}"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"{what} {option!r}: only {torch.cuda.device_count()} CUDA device(s) "
                f"are visible here; {fix}"
            )
    return dev


def resolve_node_device(
    option: str | torch.device | None = "auto", what: str = "train.device"
) -> torch.device:
    """:func:`resolve_device` for a node's training or evaluation: ``"auto"`` is the GPU this
    process sees (in a Ray simulation the one assigned to the node's actor), else the CPU; a
    CUDA device that is not visible is refused with :data:`NODE_DEVICE_FIX`."""
    return resolve_device(option, what=what, fix=NODE_DEVICE_FIX)


_OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")
"""Lower-case parts of the messages of allocators that ran out (CUDA, MPS, torch's CPU
allocator), for the ``RuntimeError`` that are not ``torch.OutOfMemoryError``."""


class MergeOutOfMemoryError(MemoryError):
    """The round merge ran out of memory on the CPU as well (the replies are not at fault)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocator ran out: ``torch.OutOfMemoryError``, ``MemoryError``,
    or a ``RuntimeError`` whose message says so (:data:`_OOM_MESSAGES`)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MESSAGES)


def on_device_or_cpu(
    compute: Callable[[torch.device], T], device: torch.device, what: str, server_round: int
) -> T:
    """``compute(device)``; if that runs out of memory (:func:`is_out_of_memory`) on a device
    other than the CPU, a logged warning and ``compute(cpu)``: the data are not at fault, the
    device is. :class:`MergeOutOfMemoryError` naming ``what`` when the CPU runs out too; any
    other error as raised."""
    cpu = torch.device("cpu")
    if device.type != "cpu":
        try:
            return compute(device)
        except (RuntimeError, MemoryError) as exc:
            if not is_out_of_memory(exc):
                raise
            _log.warning(
                "round %d: %s out of memory on %s (%s); computing it on the CPU for this round",
                server_round,
                what,
                device,
                exc,
            )
    try:
        return compute(cpu)
    except (RuntimeError, MemoryError) as exc:
        if is_out_of_memory(exc):
            raise MergeOutOfMemoryError(f"round {what} out of memory on the CPU: {exc}") from exc
        raise
