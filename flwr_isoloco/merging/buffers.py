"""Which floating tensors of a model are *buffers*: state not trained by gradients.

The server sees a state_dict only (an ArrayRecord), so every floating tensor looks alike. A
BatchNorm layer's ``running_mean`` / ``running_var`` are not parameters: each node's training
sets them to its own data's statistics. The outer optimiser must not own them: its momentum and
step size extrapolate the change of a statistic (a running variance of 1.0 that every node
reports as 0.2 becomes ``1 - 0.7 (0.8 + 0.9 x 0.8) = -0.064`` after one Nesterov step at lr 0.7,
mu 0.9, and BatchNorm then returns NaN in eval mode). A buffer is merged as FedAvg merges it::

    theta_b <- theta_b - sum_i w_i (theta_b - theta_b,i) / sum_i w_i = sum_i w_i theta_b,i / W

the weighted mean of the nodes' values (the round's bounded merge weights), with no merge rule
(Iso-C, TIES...), no outer step and no momentum.

:func:`resolve_buffers` turns a ``buffers`` specification into the set of names:

- ``"auto"`` (default): :data:`DEFAULT_BUFFER_PATTERN`, the common names of running statistics:
  a last name component ``running_*`` (torch BatchNorm / InstanceNorm / SyncBatchNorm:
  ``running_mean``, ``running_var``), ``moving_*`` (Keras-style ``moving_mean``,
  ``moving_variance``), any tensor under a ``batch_stats`` component (Flax), and parametrised
  spectral norm's power-iteration vectors (``..._u`` / ``..._v`` under ``parametrizations``);
  plus :func:`spectral_norm_vectors`. Integer tensors (``num_batches_tracked``) are never in
  the outer step.
- ``None`` / ``"none"``: no buffers (every floating tensor is a parameter: the behaviour before
  buffers were told apart).
- any other string: a regular expression, searched in each name (``re.search``).
- a callable ``fn(name, tensor) -> bool``.
- an ``nn.Module``: the names of its ``named_buffers()`` (those in the state_dict). The one
  exact answer: a state_dict does not say which tensors are parameters.
- an iterable of names (each must be a floating tensor of the model).

Variances (:data:`VARIANCE_PATTERN`: ``running_var``, ``moving_var`` / ``moving_variance``, a
Flax ``batch_stats`` ``var``) are clamped at 0 after the merge (:func:`nonnegative_variances`).
The weighted mean of the nodes' variances is never negative, but a noised one can be (central
DP adds ``N(0, (z C / k)^2)`` to the mean; local DP noises each node's value), and BatchNorm
returns NaN for ``sqrt(var + eps)`` of a negative ``var + eps``. ``max(v, 0)`` is
post-processing of the release (no privacy cost) and the nearest valid variance to it, so it
moves nothing that is valid; 0 rather than a small floor because BatchNorm adds its own
``eps`` (1e-5 by default) under the square root, and any floor above 0 would be a guess at the
data's scale.

A name alone cannot tell torch's two old-style normalisations apart: ``weight_norm`` registers
the *parameters* ``<p>_g`` and ``<p>_v`` (trained: they need the merge rule, the momentum and
the outer step), ``spectral_norm`` the parameter ``<p>_orig`` and the *buffers* ``<p>_u`` and
``<p>_v``. ``"auto"`` reads the siblings: ``<p>_u`` / ``<p>_v`` are buffers only beside a
``<p>_orig`` (:func:`spectral_norm_vectors`). A ``..._u`` / ``..._v`` without that sibling stays
a parameter: the safe side, since a buffer taken for a parameter is still merged and stepped as
the model was before buffers were told apart, while a parameter taken for a buffer would lose
its outer optimiser.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "DEFAULT_BUFFER_PATTERN",
    "VARIANCE_PATTERN",
    "check_buffers_spec",
    "merged_buffers",
    "nonnegative_variances",
    "resolve_buffers",
    "spectral_norm_vectors",
]

DEFAULT_BUFFER_PATTERN = (
    r"(^|\.)(running_[^.]*|moving_[^.]*)$"
    r"|(^|\.)batch_stats\."
    r"|(^|\.)parametrizations\.[^.]+\.\d+\._[uv]$"
)
"""The names ``buffers="auto"`` treats as buffers by their name alone (module docstring)."""

VARIANCE_PATTERN = (
    r"(^|\.)(running_var|moving_var|moving_variance)$"
    r"|(^|\.)batch_stats\.(.+\.)?var$"
)
"""The buffers that are variances, clamped at 0 after the merge (module docstring)."""

_UV = re.compile(r"^(.+)_[uv]$")
_VARIANCE = re.compile(VARIANCE_PATTERN)

_NONE = ("none", "")


def check_buffers_spec(spec: Any) -> Any:
    """``spec`` itself when it is a valid ``buffers`` argument; ``ValueError`` else (a regex
    that does not compile, a name that is not a string)."""
    if spec is None or isinstance(spec, torch.nn.Module) or callable(spec):
        return spec
    if isinstance(spec, str):
        if spec.strip().lower() not in ("auto", *_NONE):
            try:
                re.compile(spec)
            except re.error as exc:
                raise ValueError(f"buffers={spec!r} is not a regular expression: {exc}") from None
        return spec
    if isinstance(spec, Iterable) and not isinstance(spec, (bytes, Mapping)):
        names = list(spec)
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise ValueError(f"buffers: names must be strings, got {bad[0]!r}")
        return tuple(names)
    raise ValueError(
        "buffers must be 'auto', 'none', a regex, names, a callable (name, tensor) -> bool "
        f"or an nn.Module, got {spec!r}"
    )


def spectral_norm_vectors(names: Collection[str]) -> frozenset[str]:
    """The names ``<p>_u`` / ``<p>_v`` with a ``<p>_orig`` among ``names``: old-style
    ``torch.nn.utils.spectral_norm``'s power-iteration buffers, never weight_norm's trained
    ``<p>_v`` (whose sibling is ``<p>_g``; module docstring)."""
    have = set(names)
    return frozenset(
        k for k in have if (m := _UV.match(k)) is not None and f"{m.group(1)}_orig" in have
    )


def nonnegative_variances(values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``values`` (merged buffers) with every variance (:data:`VARIANCE_PATTERN`) set to
    ``max(v, 0)``; the other entries as they are (module docstring)."""
    return {k: t.clamp(min=0.0) if _VARIANCE.search(k) else t for k, t in values.items()}


def merged_buffers(
    base: Mapping[str, torch.Tensor], g: Mapping[str, torch.Tensor], buffers: Collection[str]
) -> dict[str, torch.Tensor]:
    """``theta_b = base_b - g_b`` for the keys of ``g`` in ``buffers``: the nodes' weighted
    mean when ``g_b`` is the mean of ``base_b - theta_b,i`` (in ``base``'s dtype), with
    :func:`nonnegative_variances`."""
    return nonnegative_variances({k: base[k] - g[k].to(base[k].dtype) for k in g if k in buffers})


def resolve_buffers(spec: Any, theta: Mapping[str, torch.Tensor]) -> frozenset[str]:
    """The floating tensors of ``theta`` that ``spec`` names as buffers (module docstring).

    Raises ``ValueError`` for a listed name that is not a floating tensor of ``theta``."""
    floats = [k for k, t in theta.items() if t.is_floating_point()]
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in _NONE):
        return frozenset()
    if isinstance(spec, torch.nn.Module):
        own = {name for name, _ in spec.named_buffers()}
        return frozenset(k for k in floats if k in own)
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        found = re.compile(DEFAULT_BUFFER_PATTERN)
        vectors = spectral_norm_vectors(theta)
        return frozenset(k for k in floats if found.search(k) or k in vectors)
    if isinstance(spec, str):
        found = re.compile(spec)
        return frozenset(k for k in floats if found.search(k))
    if callable(spec):
        fn: Callable[[str, torch.Tensor], bool] = spec
        return frozenset(k for k in floats if fn(k, theta[k]))
    names = frozenset(spec)
    missing = sorted(names - set(floats))
    if missing:
        raise ValueError(f"buffers: {missing[0]!r} is not a floating tensor of the model")
    return names
