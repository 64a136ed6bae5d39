"""Training precision: autocast with fp32 master weights, and the fp16 gradient scaler.

``"fp32"``: no autocast. ``"bf16"`` / ``"fp16"``: the forward (and the loss) run under
``torch.autocast`` in that dtype while the parameters, their gradients and the optimiser's
moments stay fp32 ("master weights"), so a pseudo-gradient ``theta - theta_i`` is computed in
fp32 whatever the precision. fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero,
so its backward runs on a loss scaled by ``S`` (``torch.amp.GradScaler``) and the step is
skipped when a scaled gradient is inf/NaN (``S`` halves; it doubles after 2000 clean steps).
bf16 has fp32's exponent range and needs no scaler. CPU autocast supports both dtypes.

:func:`announce` logs once per process and node where and how a node trains (the DiLoCo worker
and the LoRA clients share it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from logging import INFO

import torch
from flwr.app import Context
from flwr.common.logger import log

__all__ = [
    "PRECISIONS",
    "announce",
    "autocast",
    "autocast_dtype",
    "check_compile",
    "check_precision",
    "grad_scaler",
]

#: The precisions a worker trains (and evaluates) in.
PRECISIONS = ("fp32", "bf16", "fp16")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(value: object, what: str = "train.precision") -> str:
    """``value`` if it is one of :data:`PRECISIONS` (case and spaces ignored), else ``ValueError``
    naming the option ``what`` and the choices."""
    if isinstance(value, str) and value.strip().lower() in PRECISIONS:
        return value.strip().lower()
    raise ValueError(f"{what} {value!r} is not one of {', '.join(map(repr, PRECISIONS))}")


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (None for fp32: no autocast)."""
    return _DTYPES.get(check_precision(precision))


@contextlib.contextmanager
def autocast(device: torch.device | str, precision: str) -> Iterator[None]:
    """``torch.autocast(device.type, dtype)`` for bf16/fp16; nothing for fp32 (the same code
    path as before precision existed, bit for bit)."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        yield
        return
    with torch.autocast(torch.device(device).type, dtype=dtype):
        yield


def grad_scaler(device: torch.device | str, precision: str) -> torch.amp.GradScaler | None:
    """A fresh ``torch.amp.GradScaler`` for fp16 on ``device`` (None otherwise).

    Fresh means its scale starts at 2**16 each time: a caller that makes one per message does
    not carry the scale across messages (a few skipped steps at the start of each message
    while it backs off; they are counted, not hidden)."""
    if check_precision(precision) != "fp16":
        return None
    return torch.amp.GradScaler(torch.device(device).type)


def check_compile(value: object) -> bool:
    """``value`` if it is a bool (the ``compile`` option), else ``ValueError`` naming it."""
    if not isinstance(value, bool):
        raise ValueError(f"compile must be True or False, got {value!r}")
    return value


_ANNOUNCED: set[tuple[str, int, int]] = set()


def announce(
    who: str,
    context: Context,
    partition: object,
    device: torch.device,
    precision: str,
    compiled: bool,
) -> None:
    """Log (INFO) once per process, ``who`` and node: the device (with the GPU's name), the
    precision, whether compiled, and the process id (a simulation runs a node in several)."""
    if (who, context.run_id, context.node_id) in _ANNOUNCED:
        return
    _ANNOUNCED.add((who, context.run_id, context.node_id))
    where = str(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        where = f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    log(
        INFO,
        "%s: node %s (partition %s) trains on %s in %s%s (process %d)",
        who,
        context.node_id,
        partition,
        where,
        precision,
        ", torch.compile" if compiled else "",
        os.getpid(),
    )
