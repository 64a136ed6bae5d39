"""SparseLoCo's combine of sparse pseudo-gradients (templar's ``batch_decompress`` with
``clip_norm=True`` followed by its ``scatter_reduce(..., "mean")``; rewritten, not copied).

For one tensor, peer ``i``'s decoded delta ``d_i`` (zero where it sent nothing), its merge
weight ``w_i`` (the weights sum to 1; uniform in the reference) and ``S_i = {j : d_ij != 0}``
the entries it sent::

    n_i = ||d_i||_2,   m = lower median of (n_1..n_M)      (torch.median, as the reference)
    c_i = min(1, m / (n_i + 1e-8))                          (clip each peer to the median norm)
    g_j = sum_{i : j in S_i} w_i c_i d_ij / sum_{i : j in S_i} w_i   (0 where nobody sent j)

so an entry is the (weighted) mean over the peers that sent it, not over all ``M``: an entry one
peer of eight chose counts fully, not 1/8. With uniform weights this is the reference's
``mean`` reduce. The outer step that goes with it in the reference is plain SGD at lr 1.0
(``outer_momentum=0``): the workers' error feedback (``ef_decay`` 0.95) takes the place of
momentum.

Where we differ: an entry a peer sent with the value exactly 0 counts as not sent (the
decoded tensor cannot tell them apart; a lookup-table value of exactly 0 needs every value of
its bin to cancel). The rule acts on the 2-D tensors the ``sparseloco`` codec sends sparse;
1-D tensors (norms, biases) travel dense (``min_dims=2``), every peer sends every entry, so
they take the weighted mean, unclipped (the reference also tiles and clips them).

Arithmetic: each term is formed as ``(w_i c_i) * d_i`` and added in peer order with separate
multiplies and adds (no fused ``add(alpha=)``), so the same inputs give the same bits on any
IEEE-754 machine; :mod:`flwr_isoloco.compression.step` replays this sum on the nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "CLIP_EPS",
    "SparseMean",
    "combine_coefs",
    "lower_median_clip",
    "sparse_mean",
    "sparseloco_combine",
]

CLIP_EPS = 1e-8
"""The reference's ``1e-8`` in ``median / (norm + 1e-8)``."""


def lower_median_clip(norms: torch.Tensor) -> torch.Tensor:
    """``c_i = min(1, m / (n_i + 1e-8))`` with ``m`` the lower median of ``norms`` (module doc).

    Not :func:`~.robust.clip_factors` (the ``NormClip`` rule's): that one takes the statistics
    median (the mean of the two middle norms for an even M) and no ``1e-8``; this one follows
    the SparseLoCo reference's arithmetic."""
    med = torch.median(norms)
    return torch.clamp(med / (norms + CLIP_EPS), max=1.0)


class SparseMean:
    """``sum_i a_i d_i / sum_{i sent j} w_i`` entry by entry (0 where no peer sent ``j``),
    fed one peer at a time (:meth:`add`) in a fixed order, multiplies and adds kept apart
    (module doc). ``per_entry=False``: ``sum_i a_i d_i`` (the plain weighted sum)."""

    def __init__(self, like: torch.Tensor, per_entry: bool = True) -> None:
        self.num = torch.zeros_like(like)
        self.den = torch.zeros_like(like) if per_entry else None

    def add(self, d: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> None:
        """Peer ``d`` with its coefficient ``a`` and weight ``w`` (0-dim, ``d``'s dtype)."""
        self.num.add_(d * a)
        if self.den is not None:
            self.den.add_((d != 0).to(d.dtype) * w)

    def result(self) -> torch.Tensor:
        """The sum divided entry by entry by its senders' weight (module doc)."""
        if self.den is None:
            return self.num
        sent = self.den > 0
        return torch.where(sent, self.num / torch.where(sent, self.den, 1.0), self.num)


def sparse_mean(
    deltas: Sequence[torch.Tensor], coefs: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """:class:`SparseMean` over ``deltas`` in order (``a = coefs``, ``w = weights``: 1-D, the
    deltas' dtype)."""
    acc = SparseMean(deltas[0])
    for i, d in enumerate(deltas):
        acc.add(d, coefs[i], weights[i])
    return acc.result()


def combine_coefs(
    norms: torch.Tensor, weights: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, w)`` of :func:`sparse_mean` for the module doc's combine, from the peers' norms:
    ``a_i = w_i c_i`` (:func:`lower_median_clip`), in the norms' dtype."""
    w = torch.tensor([float(x) for x in weights], dtype=norms.dtype)
    return w * lower_median_clip(norms), w


def sparseloco_combine(
    deltas: Sequence[torch.Tensor], weights: Sequence[float], key: str = ""
) -> torch.Tensor:
    """The combine of the module doc for one 2-D tensor (``weights`` sum to 1)."""
    del key  # the same rule for every tensor
    norms = torch.stack([torch.linalg.vector_norm(d) for d in deltas])
    coefs, w = combine_coefs(norms, weights)
    return sparse_mean(deltas, coefs, w)
