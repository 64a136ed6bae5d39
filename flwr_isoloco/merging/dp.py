"""Central Gaussian mechanism on a round's sum of pseudo-gradients (the maths, no Flower).

Each site's whole update (all float tensors together) is clipped to L2 norm ``C``::

    c_i = delta_i * min(1, C / ||delta_i||_2)

and the round releases, with uniform weights and ``k`` the number of sites *sampled* (fixed
before any reply arrives; a rejected or missing reply counts as a zero update)::

    g = (sum_{i used} c_i + N(0, (z C)^2 I)) / k

Adding or removing one site changes the sum by at most ``C`` in L2 norm, so this is the
Gaussian mechanism of noise multiplier ``z`` on a sensitivity-``C`` query; whatever is computed
from ``g`` afterwards (Iso-C, outer momentum, the model) is post-processing.

Noise is a function of ``(seed, round, tensor index, attempt, nonce)`` only
(:func:`noise_like`): a round merged again in one process (a failed merge retried on fewer
replies) draws the same noise, and ``attempt`` (how many releases of that round the DP journal
already holds) with ``nonce`` (a fresh secret per release,
:mod:`flwr_isoloco.strategies.diloco.dp_journal`) makes a round redone after a crash draw new
noise, so two different sums are never released under one noise.

:func:`privatize` is the local (client-side) variant: one site clips and noises its own delta.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence

import numpy as np
import torch

__all__ = [
    "CLIP_KEY",
    "NOISE_KEY",
    "GaussianSum",
    "clip_to_norm",
    "noise_like",
    "privatize",
    "update_norm",
]

Tensors = dict[str, torch.Tensor]


def update_norm(delta: Mapping[str, torch.Tensor]) -> float:
    """``||delta||_2`` over all tensors together (fp64 accumulation)."""
    sq = math.fsum(float(t.detach().double().pow(2).sum()) for t in delta.values())
    return math.sqrt(sq)


def clip_to_norm(delta: Mapping[str, torch.Tensor], c: float) -> tuple[Tensors, float]:
    """``(delta * min(1, c / ||delta||), ||delta||)``; a zero update stays zero."""
    norm = update_norm(delta)
    if not math.isfinite(norm):
        raise ValueError("update norm is not finite")
    scale = 1.0 if norm <= c else c / norm
    if scale == 1.0:
        return dict(delta), norm
    return {k: (t.double() * scale).to(t.dtype) for k, t in delta.items()}, norm


def noise_like(
    t: torch.Tensor,
    std: float,
    seed: int,
    server_round: int,
    index: int,
    attempt: int = 0,
    nonce: int = 0,
) -> torch.Tensor:
    """``N(0, std^2)`` of ``t``'s shape in fp64, drawn from ``(seed, server_round, index)`` and,
    for ``attempt > 0`` (a round redone after a release) or ``nonce > 0`` (a release's own
    secret), ``(attempt, nonce)`` too."""
    entropy = [int(seed) & (2**63 - 1), int(server_round), int(index)]
    if attempt or nonce:
        entropy.append(int(attempt))
    if nonce:
        entropy.append(int(nonce))
    state = np.random.SeedSequence(entropy)
    gen = torch.Generator().manual_seed(int(state.generate_state(1, np.uint64)[0] >> 1))
    return torch.randn(t.shape, generator=gen, dtype=torch.float64).mul_(std)


class GaussianSum:
    """One round's mechanism: :meth:`clip` each delta, :meth:`release` each mean tensor.

    ``denominator`` is ``k``, the number of sites sampled this round. ``keys`` fixes the tensor
    order that indexes the noise (the model's float entries, in model order); ``attempt`` and
    ``nonce`` key the noise of one release (module docstring).
    """

    def __init__(
        self,
        clipping_norm: float,
        noise_multiplier: float,
        denominator: int,
        keys: Sequence[str],
        seed: int,
        server_round: int,
        attempt: int = 0,
        nonce: int = 0,
    ) -> None:
        if not (clipping_norm > 0 and math.isfinite(clipping_norm)):
            raise ValueError(f"clipping norm must be > 0 and finite, got {clipping_norm!r}")
        if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"noise multiplier must be >= 0 and finite, got {noise_multiplier!r}")
        if denominator < 1:
            raise ValueError(f"denominator must be >= 1, got {denominator!r}")
        self.c, self.z, self.k = float(clipping_norm), float(noise_multiplier), int(denominator)
        self.index = {key: i for i, key in enumerate(keys)}
        self.seed, self.server_round, self.attempt = seed, server_round, int(attempt)
        self.nonce = int(nonce)
        self.clipped = 0  # deltas scaled down this round
        self.norms: list[float] = []

    @property
    def std_of_mean(self) -> float:
        """Per-entry noise std of the released mean: ``z C / k``."""
        return self.z * self.c / self.k

    @property
    def centred_count(self) -> float:
        """``sum_i (1[||delta_i|| <= C] - 1/2)`` over the deltas clipped this round: a site
        with no delta in it (missing, rejected, or removed from the data) adds 0, any other
        +-1/2, so adding or removing one site moves it by at most 1/2 (Andrew et al. 2021)."""
        n = len(self.norms)
        return (n - self.clipped) - n / 2

    def clip(self, delta: Mapping[str, torch.Tensor]) -> Tensors:
        """``c_i`` (module docstring); counts the deltas that were scaled down."""
        out, norm = clip_to_norm(delta, self.c)
        self.norms.append(norm)
        self.clipped += norm > self.c
        return out

    def release(self, key: str, mean: torch.Tensor, used: int) -> torch.Tensor:
        """``(used * mean + N(0, (z C)^2)) / k`` for one tensor, in ``mean``'s dtype.

        ``mean`` is the uniform mean of the ``used`` clipped deltas (so ``used * mean`` is
        their sum)."""
        total = mean.double() * used
        if self.z > 0:
            std, i = self.z * self.c, self.index[key]
            total += noise_like(
                mean, std, self.seed, self.server_round, i, self.attempt, self.nonce
            )
        return total.div_(self.k).to(mean.dtype)


# ---------------------------------------------------------------------- local (client-side) DP
CLIP_KEY, NOISE_KEY = "dp-clipping-norm", "dp-noise-multiplier"
"""Train-config keys asking a worker for local DP, echoed in its reply's ConfigRecord."""


def privatize(
    delta: Mapping[str, torch.Tensor],
    clipping_norm: float,
    noise_multiplier: float,
    generator: torch.Generator | None = None,
) -> Tensors:
    """Local DP of one site's update: ``clip(delta, C) + N(0, (z C)^2 I)`` (each tensor in its
    own dtype). Any two updates of the site differ by at most ``2 C`` after clipping, so this
    release alone is the Gaussian mechanism of multiplier ``z / 2`` (replace-one relation);
    whatever the server merges from such releases is post-processing. ``generator`` None: a
    fresh one seeded from the OS (the server must not be able to regenerate the noise)."""
    if generator is None:
        generator = torch.Generator().manual_seed(secrets.randbits(63))
    clipped, _ = clip_to_norm(delta, clipping_norm)
    std = noise_multiplier * clipping_norm
    out: Tensors = {}
    for k, t in clipped.items():
        noisy = t.double()
        if std > 0 and t.is_floating_point():
            noisy = noisy + torch.randn(t.shape, generator=generator, dtype=torch.float64) * std
        out[k] = noisy.to(t.dtype)
    return out
