"""The DiLoCo worker's inner loop: H AdamW steps on the node's batches, in fp32, bf16 or fp16.

One inner step ``s`` (global: ``(server-round - 1) * H + h``) sets the learning rate of
:func:`inner_lr`, draws batch number ``cursor`` (:func:`batch_at`), accumulates the gradient of
its mean loss over micro-batches (:func:`accumulate`), clips it to ``clip-norm`` and steps AdamW.

Precision (:mod:`.precision`): the forward and the loss run under autocast; the backward, the
clipping and the step act on the fp32 parameters and moments. In fp16 the backward runs on the
loss times the scaler's ``S``; the gradient is divided by ``S`` before clipping (so the clip sees
the true norm) and a step whose gradient holds inf/NaN is skipped and counted
(:attr:`Amp.skipped`).

Time budget (``c.budget`` seconds > 0, off at 0): the loop runs inner steps until the budget is
spent, at least 1 and at most ``c.h``. After ``n`` steps taking ``t_n`` seconds in all (the
node's own clock) it takes another one iff ``n < H`` and ``t_n + t_n / n <= budget``: the next
step is predicted to last the node's mean step time so far, so a node does not overrun its
budget by more than one step's misprediction. The steps run are reported (the reply's
``inner-steps``) and the tokens are those of the steps run, so the server weighs a slow node's
shorter round by its tokens. Given the step count ``n`` the round is deterministic: it is the
first ``n`` steps of the full round (the same batches, and step ``h`` of round ``r`` keeps its
learning rate at schedule position ``(r - 1) H + h``); the count itself depends on wall time,
so two runs of the same config may differ.

Emulated speed (:class:`Pace`, for heterogeneity studies on one machine; off by default): after
each step the loop sleeps so the node runs ``f`` times slower than it computes. With a fixed
step time ``p > 0`` every step is padded to last ``f * p`` seconds, so the node's speed does not
depend on the load of a shared machine as long as a step computes in less than that (a step
that computes longer is not padded and is counted as an overrun); with ``p = 0`` a step that
computed ``t`` seconds is followed by ``(f - 1) t``. The time budget's clock sees the padded
steps, as it would see a slower machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .precision import autocast

__all__ = [
    "Amp",
    "InnerLoop",
    "Pace",
    "accumulate",
    "another_step_fits",
    "batch_at",
    "inner_lr",
    "inner_steps",
]

Named = list[tuple[str, torch.nn.Parameter]]
LossFn = Callable[[Any, Any], tuple[torch.Tensor, int]]


def inner_lr(step: int, total: int, lr: float, warmup: int, min_ratio: float) -> float:
    """Learning rate of global inner step ``s`` (0-based) of ``T = total``, warm-up ``W``::

        lr(s) = lr * (s + 1) / W                                          if s < W
        lr(s) = lr * (r + (1 - r) * (1 + cos(pi * min((s - W) / (T - W), 1))) / 2)   otherwise

    with ``r = min_ratio``. The worker's step is ``s = (server-round - 1) * H + h``,
    ``T = num-server-rounds * H``.

    Why not transformers' ``get_cosine_with_min_lr_schedule_with_warmup``: its decay part is
    bitwise this one (tested), but its warm-up is ``lr * s / W``, one step behind ours: the
    first inner step of a run would get lr 0 (a wasted step) and every warm-up step a
    different lr, so swapping would change every result (the LM demo's val loss included).
    Past ``total`` it also rises again (``cos`` is not clamped); ours stays at the minimum.
    """
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def batch_at(data: Any, index: int, seed: int) -> Any:
    """Batch number ``index`` of this node: callable data, or a sequence in seeded epoch order."""
    if callable(data):
        return data(index)
    if not isinstance(data, Sequence):
        raise ValueError(
            f"data_fn must return a sequence of batches or a callable, got {type(data).__name__}"
        )
    n = len(data)
    if n == 0:
        raise ValueError("data_fn returned no training batches")
    epoch, pos = divmod(index, n)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return data[int(torch.randperm(n, generator=g)[pos])]


def _chunks(batch: Any, micro_batch: int) -> list[Any]:
    """``batch`` split along dim 0 into pieces of ``micro_batch`` rows (0: the whole batch)."""
    if micro_batch <= 0:
        return [batch]
    if not isinstance(batch, torch.Tensor):
        raise ValueError(
            f"micro_batch needs tensor batches (split along dim 0), got {type(batch).__name__}"
        )
    return list(torch.split(batch, micro_batch, dim=0))


@dataclass
class Amp:
    """Precision of one message's inner loop: autocast for the forward, the fp16 scaler."""

    device: torch.device
    precision: str = "fp32"
    scaler: torch.amp.GradScaler | None = None
    skipped: int = 0

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, opt: torch.optim.Optimizer, params: list[torch.Tensor], clip: float) -> None:
        """Clip the true gradient to ``clip`` (if > 0) and step; fp16: unscale first, skip a
        step with inf/NaN gradients (the scale then halves, which is how a skip is counted)."""
        if self.scaler is None:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            return
        self.scaler.unscale_(opt)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        scale = self.scaler.get_scale()
        self.scaler.step(opt)
        self.scaler.update()
        self.skipped += int(self.scaler.get_scale() < scale)


def accumulate(model, named, batch, loss_fn, micro_batch: int, amp: Amp | None = None):
    """Gradient of the batch's mean loss, accumulated over micro-batches of ``m`` rows::

        L = sum_j n_j L_j / N,   grad L = (sum_j grad(n_j L_j)) / N,   N = sum_j n_j

    with ``L_j`` the mean loss of micro-batch ``j`` over its ``n_j`` predicted tokens: the
    full batch's loss and gradient up to fp32 rounding, at the activation memory of ``m`` rows.
    ``model`` is what ``loss_fn`` calls (the model or its compiled wrapper). Returns ``(L, N)``."""
    amp = amp if amp is not None else Amp(torch.device("cpu"))
    parts = _chunks(batch, micro_batch)
    if len(parts) == 1:
        with autocast(amp.device, amp.precision):
            loss, n = loss_fn(model, batch)
        if torch.isfinite(loss):
            amp.backward(loss)
        return loss.detach(), int(n)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for part in parts:
        with autocast(amp.device, amp.precision):
            loss, n = loss_fn(model, part)
        if not torch.isfinite(loss):
            return loss.detach(), int(n)
        amp.backward(loss * int(n))
        total += float(loss.detach()) * int(n)
        count += int(n)
    for _, p in named:
        if p.grad is not None:
            p.grad.div_(count)
    return (total / count).float(), count


@dataclass
class InnerLoop:
    """What one message's inner steps run: the forward (model or compiled wrapper), the
    optimiser over ``named``, the loss, micro-batch rows and the precision."""

    forward: Any
    opt: torch.optim.Optimizer
    named: Named
    loss_fn: LossFn
    micro_batch: int
    amp: Amp


def another_step_fits(done: int, elapsed: float, h: int, budget: float) -> bool:
    """Whether a loop that ran ``done`` steps in ``elapsed`` seconds takes another (module
    docstring): ``done < h`` and, with a budget (> 0), ``elapsed + elapsed / done <= budget``."""
    if done >= h:
        return False
    if budget <= 0 or done == 0:
        return True
    return elapsed + elapsed / done <= budget


@dataclass
class Pace:
    """Emulated speed (module docstring; the train handler's ``pace=``): ``slowdown``
    ``f >= 1``, fixed step time ``step_s`` ``p >= 0`` (0: scale the node's own compute). Counts
    the overruns."""

    slowdown: float = 1.0
    step_s: float = 0.0
    overruns: int = 0

    def __post_init__(self) -> None:
        f, p = self.slowdown, self.step_s
        for name, value, low in (("slowdown", f, 1.0), ("step_s", p, 0.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number >= {low:g}, got {value!r}")
            if not (math.isfinite(value) and value >= low):
                raise ValueError(f"{name} must be a finite number >= {low:g}, got {value!r}")

    @property
    def active(self) -> bool:
        return self.slowdown > 1.0 or self.step_s > 0.0

    def pad(self, computed_s: float) -> float:
        """Seconds to sleep after a step that computed ``computed_s``: ``f p - t`` (``p > 0``;
        0 and an overrun when negative) or ``(f - 1) t``."""
        if self.step_s > 0:
            left = self.slowdown * self.step_s - computed_s
            if left < 0:
                self.overruns += 1
            return max(left, 0.0)
        return (self.slowdown - 1.0) * computed_s

    def __call__(self, computed_s: float) -> None:
        seconds = self.pad(computed_s)
        if seconds > 0:
            time.sleep(seconds)


def inner_steps(loop: InnerLoop, data, cursor: int, node_seed: int, c, clock=None, pace=None):
    """Run up to ``c.h`` AdamW steps from batch ``cursor``; returns (losses, tokens, last lr,
    cursor). ``len(losses)`` is the number of steps run: ``c.h``, or fewer when
    ``c.budget`` (seconds, 0 = off; absent: off) runs out first (:func:`another_step_fits`,
    timed with ``clock``, default ``time.perf_counter``; the count depends on wall time).

    ``c`` holds the round's ``rnd``, ``h``, ``rounds``, ``lr``, ``warm``, ``min_ratio`` and
    ``clip``; ``pace`` (a :class:`Pace`, or None) slows each step. A non-finite loss raises
    ``FloatingPointError`` (nothing is stepped on it)."""
    losses, tokens, step_lr = [], 0, c.lr
    params = [p for _, p in loop.named]
    budget = float(getattr(c, "budget", 0.0) or 0.0)
    clock = clock or time.perf_counter
    t0 = clock() if budget > 0 else 0.0
    i = 0
    while another_step_fits(i, clock() - t0 if budget > 0 else 0.0, c.h, budget):
        step_lr = inner_lr((c.rnd - 1) * c.h + i, c.rounds * c.h, c.lr, c.warm, c.min_ratio)
        for group in loop.opt.param_groups:
            group["lr"] = step_lr
        started = time.perf_counter() if pace is not None else 0.0
        batch = batch_at(data, cursor, node_seed)
        if isinstance(batch, torch.Tensor):
            batch = batch.to(loop.amp.device)
        cursor += 1
        loop.opt.zero_grad(set_to_none=True)
        loss, n = accumulate(
            loop.forward, loop.named, batch, loop.loss_fn, loop.micro_batch, loop.amp
        )
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite training loss at inner step {i} of round {c.rnd}")
        loop.amp.step(loop.opt, params, c.clip)
        losses.append(float(loss.detach()))
        tokens += int(n)
        i += 1
        if pace is not None:
            pace(time.perf_counter() - started)
    return losses, tokens, step_lr, cursor
