"""A private on-disk store for one round's decoded deltas (no maths here).

Rules that need every worker's delta at once (TIES, DARE, TSV-M, Iso-CTS, a norm-ratio check)
would hold ``M`` model copies in memory. Instead each decoded delta is written, as it arrives,
to its own safetensors file in a directory made by :func:`tempfile.mkdtemp` (mode 0700: only
this user can read the round's updates), and the merge reads the ``M`` copies of one tensor
at a time: memory ``O(M x largest tensor)``, or, for a rule that reads row blocks
(:attr:`~.rules.MergeRule.rows`, e.g. TIES), ``O(largest tensor + a fixed block budget)``.
The directory is removed by :meth:`SpillStore.close` (a context manager: also on error).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["SpillStore"]


class SpillStore:
    """Deltas on disk, one file per entry, read back one tensor at a time.

    ``put(delta) -> entry``; ``get(entry, key) -> tensor``; ``rows(entry, key, start, stop)``
    (a block of rows of one tensor); ``drop(entry)``; ``close()``.
    ``dir`` is the parent directory (default: the system temporary directory).
    """

    def __init__(self, dir: str | os.PathLike | None = None, prefix: str = "flwr-isoloco-round-"):
        self.path = tempfile.mkdtemp(prefix=prefix, dir=dir)  # created with mode 0700
        self._files: dict[int, str] = {}
        self._next = 0
        self.bytes_written = 0

    def __enter__(self) -> SpillStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._files)

    def put(self, delta: Mapping[str, torch.Tensor]) -> int:
        """Write ``delta`` (name -> tensor) to a new file; return its entry number."""
        if self.path is None:
            raise ValueError("spill store is closed")
        entry = self._next
        self._next += 1
        path = os.path.join(self.path, f"{entry}.safetensors")
        tensors = {k: t.detach().cpu().contiguous() for k, t in delta.items()}
        save_file(tensors, path)
        self.bytes_written += os.path.getsize(path)
        self._files[entry] = path
        return entry

    def get(self, entry: int, key: str) -> torch.Tensor:
        """Tensor ``key`` of ``entry`` (read from disk; only that tensor)."""
        with safe_open(self._files[entry], framework="pt") as f:
            return f.get_tensor(key)

    def rows(self, entry: int, key: str, start: int, stop: int | None) -> torch.Tensor:
        """Rows ``start:stop`` (first dimension) of tensor ``key`` of ``entry``; only those bytes
        are read."""
        with safe_open(self._files[entry], framework="pt") as f:
            return f.get_slice(key)[start:stop]

    def drop(self, entry: int) -> None:
        """Delete one entry's file."""
        path = self._files.pop(entry, None)
        if path is not None and os.path.exists(path):
            os.remove(path)

    def close(self) -> None:
        """Remove the directory and every file in it (idempotent)."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        self.path = None
        self._files = {}
