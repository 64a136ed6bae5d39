"""Synchronous DiLoCo / IsoLoCo rounds restated in plain torch (fp64), independently of
``flwr_isoloco``: tests pin a strategy's model against these documented formulas instead of
against a second run of the same code path (which could not fail).

One round ``r`` (every node sampled, every reply used): node ``p`` trains from ``theta``
(``local(theta_fp32, p, r)``, in fp32 as the node does); ``delta_p = theta - theta_p``; ``g``
is the merge of the deltas with weights ``w_p`` (:func:`mean` or a rule below, applied to 2-D
tensors; other tensors take the weighted mean); then the outer step (docs of
``flwr_isoloco/merging/outer.py``, ``torch.optim.SGD`` with ``dampening=0``)::

    b <- mu b + g;   u = g + mu b (Nesterov) | b (heavy-ball) | g (mu = 0)
    u <- transform(u)   (IsoLoCo orthogonalize="update": Iso-C of u, 2-D tensors)
    theta <- theta - lr u
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Tensors = dict[str, torch.Tensor]
Rule = Callable[[Sequence[torch.Tensor], Sequence[float]], torch.Tensor]


def mean(ds: Sequence[torch.Tensor], ws: Sequence[float]) -> torch.Tensor:
    """``sum_p w_p d_p / sum_p w_p``."""
    return sum(w * d for d, w in zip(ds, ws, strict=True)) / sum(ws)


def iso_c(g: torch.Tensor) -> torch.Tensor:
    """Iso-C of one matrix: every singular value set to their mean, ``mean(s) U V^T``."""
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    return s.mean() * u @ vh


def capped_iso_c(g: torch.Tensor, kappa: float) -> torch.Tensor:
    """The drop-in merge: ``U diag(min(t, kappa s)) V^T`` with ``t`` such that
    ``sum min(t, kappa s)^2 = sum s^2`` (the mean's Frobenius norm), ``t`` by bisection."""
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    target, lo, hi = float((s**2).sum()), 0.0, float(s[0])
    for _ in range(200):
        t = (lo + hi) / 2
        lo, hi = (t, hi) if float((torch.clamp(kappa * s, max=t) ** 2).sum()) < target else (lo, t)
    return (u * torch.clamp(kappa * s, max=hi)) @ vh


def of_the_mean(fn: Callable[[torch.Tensor], torch.Tensor]) -> Rule:
    """A spectral rule: ``fn`` of the weighted mean."""
    return lambda ds, ws: fn(mean(ds, ws))


def ties(prune_fraction: float) -> Rule:
    """TIES: each worker keeps its ``max(1, int((1 - p) n))`` largest ``|entries|``, the sign of
    the weighted sum of the kept entries is elected, and the kept entries of that sign are
    averaged with their weights (0 where no entry agrees)."""

    def rule(ds, ws):
        kept = []
        for d in ds:
            flat = d.flatten()
            keep = max(1, int((1 - prune_fraction) * flat.numel()))
            mask = torch.zeros_like(flat, dtype=torch.bool)
            mask[flat.abs().argsort(descending=True)[:keep]] = True
            kept.append(torch.where(mask, flat, 0.0))
        sign = torch.sign(sum(w * k for k, w in zip(kept, ws, strict=True)))
        agree = [(torch.sign(k) == sign) & (sign != 0) for k in kept]
        num = sum(w * torch.where(a, k, 0.0) for k, a, w in zip(kept, agree, ws, strict=True))
        den = sum(w * a.double() for a, w in zip(agree, ws, strict=True))
        return torch.where(den > 0, num / den.clamp_min(1e-300), 0.0).view_as(ds[0])

    return rule


def sync_rounds(
    theta0: Tensors,
    local: Callable[[Tensors, int, int], Tensors],
    rounds: int,
    weights: Sequence[float],
    lr: float,
    momentum: float,
    nesterov: bool,
    rule: Rule | None = None,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Tensors:
    """``theta`` after ``rounds`` synchronous rounds of ``len(weights)`` nodes (module docstring);
    ``rule`` and ``transform`` act on 2-D tensors only."""
    theta = {k: v.double() for k, v in theta0.items()}
    buf: Tensors = {}
    for rnd in range(1, rounds + 1):
        sent = {k: v.float() for k, v in theta.items()}
        models = [local(sent, p, rnd) for p in range(len(weights))]
        new = {}
        for k, t in theta.items():
            ds = [t - m[k].double() for m in models]
            spectral = t.ndim == 2
            g = (rule if rule is not None and spectral else mean)(ds, weights)
            if momentum == 0:
                u = g
            else:
                buf[k] = momentum * buf[k] + g if k in buf else g
                u = g + momentum * buf[k] if nesterov else buf[k]
            if transform is not None and spectral:
                u = transform(u)
            new[k] = t - lr * u
        theta = new
    return theta


def assert_close(got: Tensors, want: Tensors, tol: float = 1e-5) -> None:
    """``got`` (the strategy's fp32 model) is ``want`` (fp64) to ``tol`` times its largest entry:
    fp32 round-off over a few rounds, far below what any change of the maths moves."""
    assert set(got) == set(want)
    for k, w in want.items():
        scale = float(w.abs().max())
        torch.testing.assert_close(
            got[k].double(), w, rtol=0, atol=tol * scale, msg=lambda m, k=k: f"{k}: {m}"
        )
