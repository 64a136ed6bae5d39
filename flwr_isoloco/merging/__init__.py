"""Merge rules for pseudo-gradients (the repository's ``docs/algorithms.md`` ("Algorithms") section 2), pure torch, no Flower.

Public API: :data:`MERGE_RULES`, :func:`merge`, :class:`StreamingMerger`, :func:`iso_c`,
:func:`polar`, :func:`resolve_device`, :class:`MergeRule`, and :class:`RoundMerge` (a strategy round's merge: every
rule, streaming or not, the DARE seed per round and the orthogonalised-update transform).
"""

from .device import resolve_device
from .fold import RoundMerge
from .merge import merge
from .polar import iso_c, newton_schulz_polar, ns_coefficients, polar
from .rules import MERGE_RULES, MergeRule
from .streaming import StreamingMerger

__all__ = [
    "MERGE_RULES",
    "MergeRule",
    "RoundMerge",
    "StreamingMerger",
    "iso_c",
    "merge",
    "newton_schulz_polar",
    "ns_coefficients",
    "polar",
    "resolve_device",
]
