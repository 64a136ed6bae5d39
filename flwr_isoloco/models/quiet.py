"""Hugging Face quietly: :func:`quiet_hf` silences transformers' per-call progress bars
("Loading weights", "Writing model shards") and info logs; every ``from_pretrained`` /
``save_pretrained`` of the library runs inside it, so simulated clients do not print one bar
each per round.

A leaf module (it imports nothing of the package), so that :mod:`.classifier`, :mod:`.hf` and
:mod:`.export` can all use it without importing each other. :mod:`.export` re-exports it
(``from flwr_isoloco.models.export import quiet_hf`` keeps working).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

__all__ = ["quiet_hf"]


@contextlib.contextmanager
def quiet_hf() -> Iterator[None]:
    """transformers' progress bars off and its logging at ERROR inside the block; both restored.

    The settings are process-wide: a concurrent thread that loads a model meanwhile is quiet
    too (harmless; nothing else changes).
    """
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecation notices inside HF
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
