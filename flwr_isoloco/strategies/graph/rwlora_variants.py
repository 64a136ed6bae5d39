"""RW-LoRA variants for label-skewed shards: decaying lr, momentum across hops, averaged token.

All three are off by default (the paper's walk: every option's neutral value skips its code,
so the token, the messages and the bytes are those of the plain walk, bit for bit).

- **Decaying client lr** (``lr_decay_hops = t0 > 0``): the TRAIN config of hop ``t`` (``t`` =
  accepted hops so far, 0 for the first) carries ``lr = lr0 / sqrt(1 + t / t0)``; the LoRA
  client already takes ``lr`` from the message config.
- **Momentum across hops** (``hop_momentum = mu > 0``): with the hop's update
  ``u_t = token_{t-1} - reply_t`` (the checked reply), ``m_t = mu m_{t-1} + u_t`` and the new
  token is ``token_{t-1} - m_t`` (heavy ball on the walk's adapter; ``m_0 = 0``).
- **Averaged token**, exponential (``average_decay = beta > 0``): ``avg_1 = token_1``,
  ``avg_t = beta avg_{t-1} + (1 - beta) token_t``; or a tail average (``tail_average_from =
  H >= 1``): ``avg_t = mean(token_H, ..., token_t)`` for ``t >= H`` (``H = 1``: every token,
  Polyak-Ruppert). :meth:`current_arrays` (what the app evaluates and exports) is ``avg``
  instead of the last iterate (before hop ``H``: the token). The walk trains the token.

Momentum and the average are kept on the server: in Flower every token crosses the server
anyway, so they cost no message bytes. A peer-to-peer deployment would have to carry each with
the token (one more adapter per hop each), so ``bytes-p2p`` counts one adapter more per moved
hop for each of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from flwr_isoloco.strategies.core.wire import _record_of

__all__ = ["RWLoRAVariants", "check_variant_options"]


def check_variant_options(
    lr: float | None,
    lr_decay_hops: float,
    hop_momentum: float,
    average_decay: float,
    tail_average_from: int = 0,
) -> None:
    """``ValueError`` naming the bad option (``lr`` is needed only with ``lr_decay_hops``)."""
    if isinstance(tail_average_from, bool) or not isinstance(tail_average_from, int):
        raise ValueError(f"tail_average_from must be an int >= 0, got {tail_average_from!r}")
    if tail_average_from < 0:
        raise ValueError(f"tail_average_from must be an int >= 0, got {tail_average_from!r}")
    if tail_average_from and average_decay:
        raise ValueError("tail_average_from and average_decay: choose one average")
    if not (math.isfinite(lr_decay_hops) and lr_decay_hops >= 0):
        raise ValueError(f"lr_decay_hops must be a finite number >= 0, got {lr_decay_hops!r}")
    if lr_decay_hops > 0 and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr_decay_hops > 0 needs the base lr (finite, > 0), got lr={lr!r}")
    for name, x in (("hop_momentum", hop_momentum), ("average_decay", average_decay)):
        if not (math.isfinite(x) and 0 <= x < 1):
            raise ValueError(f"{name} must be in [0, 1), got {x!r}")


class RWLoRAVariants:
    """Mixin of :class:`~flwr_isoloco.strategies.RWLoRA`: the options of the module docstring."""

    def _init_variants(
        self,
        lr: float | None,
        lr_decay_hops: float,
        hop_momentum: float,
        average_decay: float,
        tail_average_from: int = 0,
    ) -> None:
        check_variant_options(
            lr, float(lr_decay_hops), float(hop_momentum), float(average_decay), tail_average_from
        )
        self.tail_average_from = tail_average_from
        self.lr = None if lr is None else float(lr)
        self.lr_decay_hops = float(lr_decay_hops)
        self.hop_momentum = float(hop_momentum)
        self.average_decay = float(average_decay)
        self.momentum: dict[str, torch.Tensor] | None = None
        self.average: dict[str, torch.Tensor] | None = None

    def hop_lr(self) -> float | None:
        """``lr0 / sqrt(1 + t / t0)`` for the next hop (``t`` = accepted hops), or None (off)."""
        if self.lr_decay_hops <= 0:
            return None
        return self.lr / math.sqrt(1.0 + len(self.trajectory) / self.lr_decay_hops)

    def carried_adapters(self) -> int:
        """Adapters a peer-to-peer walk would carry besides the token (momentum, average)."""
        averaged = self.average_decay > 0 or self.tail_average_from > 0
        return int(self.hop_momentum > 0) + int(averaged)

    def _variant_token(
        self, old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The new token after momentum (``old - m_t``), and the average updated with it."""
        token = dict(new)
        if self.hop_momentum > 0:
            u = {k: old[k].float() - new[k] for k in old}
            prev = self.momentum
            self.momentum = {
                k: u[k] if prev is None else self.hop_momentum * prev[k] + u[k] for k in u
            }
            token = {k: old[k].float() - self.momentum[k] for k in old}
        b, prev = self.average_decay, self.average
        t = len(self.trajectory) + 1  # this hop's index (1 = the first accepted hop)
        if self.tail_average_from > 0 and t >= self.tail_average_from:
            b = 1.0 - 1.0 / (t - self.tail_average_from + 1)  # running mean from hop H
        elif self.tail_average_from > 0:
            return token
        if b > 0 or self.tail_average_from > 0:
            self.average = {
                k: token[k].clone() if prev is None else b * prev[k] + (1.0 - b) * token[k]
                for k in token
            }
        return token

    def averaged_arrays(self):
        """The averaged token as an ArrayRecord, or None (off, or before the first hop)."""
        return None if self.average is None else _record_of(self.average)

    def _variant_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Checkpoint tensor groups (only those in use: the plain walk's state is unchanged)."""
        out = {}
        if self.momentum is not None:
            out["momentum"] = dict(self.momentum)
        if self.average is not None:
            out["average"] = dict(self.average)
        return out

    def _load_variant_state(self, tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        m, a = tensors.get("momentum") or {}, tensors.get("average") or {}
        self.momentum = {k: t.float() for k, t in m.items()} if m else None
        self.average = {k: t.float() for k, t in a.items()} if a else None
