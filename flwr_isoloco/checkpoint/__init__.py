"""Checkpoints: atomic, tamper-evident files of tensors and JSON meta, and the checks every
field read back from one passes.

- :mod:`.store`: writing and reading one checkpoint file (safetensors, digests, atomic
  replace), the helpers for atomic JSON and byte files;
- :mod:`.spec`: :class:`CheckpointError` and the field and tensor checks (:class:`Field`,
  :func:`check_fields`, :func:`check_tensors`) the strategies' restores use;
- :mod:`.safetensors_stream`: the safetensors bytes written tensor by tensor, without a copy.
"""

from . import store
from .store import *  # noqa: F403 (store.__all__ is this package's API)

__all__ = list(store.__all__)
