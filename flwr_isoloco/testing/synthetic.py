"""Synthetic pseudo-gradients for tests and benchmarks (seeded, CPU, fp32).

- :func:`adam_pseudo_gradient`: ``theta - theta_T`` after T Adam steps on a least-squares loss
  ``L(W) = 1/2 tr(W C W^T) - tr(W D^T)`` (gradient ``W C - D``, ``C = A A^T / N`` for random data
  ``A``), i.e. what a DiLoCo worker sends for a linear layer. Adam's sign-like steps give the
  high-rank spectrum with many small singular values that makes Newton-Schulz work hard.
- :func:`low_rank_plus_noise`: ``U diag(1/i) V^T + noise``, a decaying spectrum with a floor.
- :func:`llama_shapes`: the 2-D and 1-D parameter shapes of a small LLaMA-style model.
"""

from __future__ import annotations

import math

import torch

__all__ = ["adam_pseudo_gradient", "low_rank_plus_noise", "llama_shapes", "llama_delta"]


def adam_pseudo_gradient(
    m: int, n: int, seed: int = 0, steps: int = 10, lr: float = 1e-3, noise: float = 0.1
) -> torch.Tensor:
    """``W_0 - W_T`` after ``steps`` Adam steps (betas 0.9/0.999) from a random ``W_0``."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(m, n, generator=gen) / math.sqrt(n)
    target = torch.randn(m, n, generator=gen) / math.sqrt(n)
    data = torch.randn(n, 2 * n, generator=gen)
    cov = data @ data.T / (2 * n)
    rhs = target @ cov + noise * torch.randn(m, n, generator=gen) / math.sqrt(n)
    w, m1, m2 = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for t in range(1, steps + 1):  # torch.optim.Adam's update, written out (no optim import)
        grad = w @ cov - rhs
        m1.mul_(beta1).add_(grad, alpha=1 - beta1)
        m2.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (m2 / (1 - beta2**t)).sqrt_().add_(eps)
        w.addcdiv_(m1, denom, value=-lr / (1 - beta1**t))
    return w0 - w


def low_rank_plus_noise(m: int, n: int, seed: int = 0, noise: float = 0.05) -> torch.Tensor:
    """``U diag(1/i) V^T + noise * G / sqrt(max(m, n))`` with orthonormal U, V, Gaussian G."""
    gen = torch.Generator().manual_seed(seed)
    r = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, r, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(n, r, generator=gen))
    s = 1.0 / torch.arange(1, r + 1, dtype=torch.float32)
    return (u * s) @ v.T + noise * torch.randn(m, n, generator=gen) / math.sqrt(max(m, n))


def llama_shapes(
    hidden: int, layers: int = 4, vocab: int = 8192, intermediate: int | None = None
) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a LLaMA-style decoder (intermediate: 8/3 hidden, rounded up to 256)."""
    if intermediate is None:
        intermediate = 256 * math.ceil(8 * hidden / 3 / 256)
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{name}.weight"] = (hidden, hidden)
        shapes[p + "mlp.gate_proj.weight"] = (intermediate, hidden)
        shapes[p + "mlp.up_proj.weight"] = (intermediate, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, intermediate)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def llama_delta(
    shapes: dict[str, tuple[int, ...]], seed: int, scale: float = 1e-3
) -> dict[str, torch.Tensor]:
    """A worker's pseudo-gradient: a shared part (seed 0) plus this worker's part (Gaussian).

    Cheap enough to make 32 of; the shared part makes workers correlated, as in DiLoCo.
    """
    shared = torch.Generator().manual_seed(0)
    own = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=shared)
        t.add_(torch.randn(shape, generator=own)).mul_(scale)
        out[name] = t
    return out
