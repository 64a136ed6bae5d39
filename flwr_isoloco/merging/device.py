"""Where the server merge computes: :func:`resolve_device`; out-of-memory errors told apart.

The merge moves each tensor's M worker slices to the device, merges there and brings the result
back to the CPU, so only one tensor's slices (and its temporaries) live on the device at a time.
``"auto"`` (the default) uses CUDA where ``torch.cuda.is_available()``, else the CPU; results on
the CPU are the same code path, bit for bit, whichever of ``None``, ``"auto"`` or ``"cpu"`` led
there.

Out of memory is the server's problem, not the replies': :func:`is_out_of_memory` tells such an
error (``torch.OutOfMemoryError``, a ``RuntimeError`` is its base) from one caused by the data
(a bad delta, an SVD that does not converge), so a round merge can retry on the CPU instead of
rejecting every reply, and raise :class:`MergeOutOfMemoryError` (not a ``RuntimeError``: no
caller mistakes it for a bad reply) when the CPU runs out too.
"""

from __future__ import annotations

import torch

__all__ = [
    "DEVICE_CHOICES",
    "MergeOutOfMemoryError",
    "is_out_of_memory",
    "parse_device",
    "resolve_device",
]

#: Spellings :func:`resolve_device` accepts besides a ``torch.device``.
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:<index>")


def parse_device(option: str | torch.device | None) -> torch.device | None:
    """The device ``option`` names (None for ``None`` / ``"auto"``), not checked to exist.

    Raises ``ValueError`` naming the option for a spelling that is not a CPU or CUDA device
    (a run-config pre-check, made where the server's GPUs may not be visible).
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
            f"merge device {option!r} is not one of {', '.join(DEVICE_CHOICES)} (or a torch.device)"
        )
    return dev


def resolve_device(option: str | torch.device | None = "auto") -> torch.device:
    """The ``torch.device`` for a ``device`` option.

    ``None`` or ``"auto"``: ``cuda`` (the current CUDA device) where ``torch.cuda.is_available()``,
    else ``cpu``. ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``: that device, checked
    to exist. Raises ``ValueError`` naming the option for anything else (unknown spelling, CUDA
    asked for but not available, index out of range).
    """
    dev = parse_device(option)
    if dev is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"merge device {option!r}: no CUDA device is visible here "
                "(torch.cuda.is_available() is False); use 'auto' or 'cpu'"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"merge device {option!r}: only {torch.cuda.device_count()} CUDA device(s)"
            )
    return dev


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
