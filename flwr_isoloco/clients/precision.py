"""Training precision: autocast with fp32 master weights, and the fp16 gradient scaler.

``"fp32"``: no autocast. ``"bf16"`` / ``"fp16"``: the forward (and the loss) run under
``torch.autocast`` in that dtype while the parameters, their gradients and the optimiser's
moments stay fp32 ("master weights"), so a pseudo-gradient ``theta - theta_i`` is computed in
fp32 whatever the precision. fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero,
so its backward runs on a loss scaled by ``S`` (``torch.amp.GradScaler``) and the step is
skipped when a scaled gradient is inf/NaN (``S`` halves; it doubles after 2000 clean steps).
bf16 has fp32's exponent range and needs no scaler. CPU autocast supports both dtypes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["PRECISIONS", "autocast", "autocast_dtype", "check_precision", "grad_scaler"]

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
