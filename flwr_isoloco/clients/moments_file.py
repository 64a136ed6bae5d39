"""The DiLoCo worker's AdamW moments in a memory-mapped file on the node's disk.

Flat layout (:func:`~flwr_isoloco.clients.adamw_state.adamw_to_flat`): the file holds a
4096-byte header, then ``exp_avg`` (N fp32), ``exp_avg_sq`` (N fp32) and ``step`` (P fp32) for
N trainable values in P parameters, zero-padded to a multiple of :data:`ROW` int64 words. On the
CPU the optimiser's moments *are* views of the mapping (``MAP_SHARED``): AdamW updates them in
place, so keeping them costs no copy, and a process that reads the file next (a fresh ClientApp
process, another Ray actor) maps it without copying either. Only the header changes when a
message ends: the token of this write and the checksum of the values.

Checks (the file is hostile until they pass; :class:`MomentsFileError` names the first that
fails): the magic and version, the exact file size, the header's token and checksums equal to
the handle that ``context.state`` holds (:func:`handle`, written by the same message), the
names-and-shapes digest of the model, and the checksum recomputed over every value word::

    w_j      = the file's values as int64 words, in rows of ROW words (r = 0, 1, ...)
    s_r      = sum_j w_j over row r
    check1   = sum_r s_r                        (all sums and products modulo 2^64)
    check2   = sum_r s_r * (r mod 524_287 + 1)

``check1`` changes with any single changed word (the sum moves by a non-zero amount modulo
2^64); ``check2`` changes when rows are swapped. Both are one read of the values (~0.1 s per GB on a
CPU), far less than a cryptographic hash; they detect damage and a stale or foreign file, not a
forger who can rewrite the node's private folder (who could as well replace the code).

A message that fails after AdamW's first step leaves values that no checksum describes: the next
reader finds the mismatch and the node restarts its optimiser (logged), as with a lost state.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "HEADER_BYTES",
    "ROW",
    "MomentsFileError",
    "checksums",
    "create",
    "handle",
    "names_digest",
    "open_verified",
    "seal",
]

MAGIC = b"FLWRISOM"
VERSION = 1
HEADER_BYTES = 4096
ROW = 512  # int64 words per checksum row
_HEAD = struct.Struct("<8sII16sQQqq32s")  # magic, version, 0, token, N, P, check1, check2, names


class MomentsFileError(ValueError):
    """A moments file that must not be used (the message says which check failed)."""


def names_digest(named: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """sha256 of the trainable parameters' names and shapes, in order."""
    h = hashlib.sha256()
    for name, p in named:
        h.update(f"{name}:{tuple(p.shape)};".encode())
    return h.digest()


def _words(n: int, p: int) -> int:
    """fp32 values (2N + P), padded to whole rows of ROW int64 words."""
    return -(-(2 * n + p) // (2 * ROW)) * 2 * ROW


def checksums(values: torch.Tensor) -> tuple[int, int]:
    """``(check1, check2)`` of a 1-D fp32 buffer of whole rows (module docstring)."""
    rows = values.view(torch.int64).reshape(-1, ROW).sum(dim=1)
    weight = torch.arange(rows.numel(), dtype=torch.int64) % 524_287 + 1
    return int(rows.sum()), int((rows * weight).sum())


def _map(path: Path, n: int, p: int) -> torch.Tensor:
    """The values of ``path`` as a writable fp32 tensor over a shared mapping."""
    words = _words(n, p)
    arr = np.memmap(path, dtype=np.float32, mode="r+", offset=HEADER_BYTES, shape=(words,))
    return torch.from_numpy(arr)


def create(path: Path, n: int, p: int) -> torch.Tensor:
    """A new zero-filled file for ``n`` values in ``p`` parameters (private, mode 0600; an
    existing one is replaced); its values, mapped."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".new")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, HEADER_BYTES + 4 * _words(n, p))
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return _map(path, n, p)


def views(values: torch.Tensor, n: int, p: int) -> dict[str, torch.Tensor]:
    """``exp_avg``, ``exp_avg_sq``, ``step`` as views of the mapped ``values``."""
    return {
        "exp_avg": values[:n],
        "exp_avg_sq": values[n : 2 * n],
        "step": values[2 * n : 2 * n + p],
    }


def seal(path: Path, values: torch.Tensor, n: int, p: int, token: bytes, names: bytes):
    """Write the header for the current ``values``; returns ``(check1, check2)``."""
    c1, c2 = checksums(values)
    head = _HEAD.pack(MAGIC, VERSION, 0, token, n, p, c1, c2, names)
    with open(path, "r+b") as fh:
        fh.write(head.ljust(HEADER_BYTES, b"\0"))
    return c1, c2


def handle(path: Path, token: bytes, n: int, p: int, checks: tuple[int, int]) -> dict:
    """What ``context.state`` keeps of a sealed file (a ConfigRecord's content)."""
    return {
        "path": str(path),
        "token": token.hex(),
        "numel": n,
        "params": p,
        "check1": checks[0],
        "check2": checks[1],
    }


def open_verified(h, names: bytes, n: int, p: int) -> tuple[torch.Tensor, bytes]:
    """The values of the file ``h`` (a handle) names, mapped, after every check of the module
    docstring; ``(values, token)``. Raises :class:`MomentsFileError` naming the failed check."""
    try:
        path = Path(str(h["path"]))
        want = (bytes.fromhex(str(h["token"])), int(h["numel"]), int(h["params"]))
        checks = (int(h["check1"]), int(h["check2"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise MomentsFileError(f"handle unreadable ({exc})") from None
    if want[1:] != (n, p):
        raise MomentsFileError(
            f"handle is for {want[1]} values / {want[2]} parameters, the model has {n} / {p}"
        )
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(_HEAD.size)
    except OSError as exc:
        raise MomentsFileError(f"{path} unreadable ({exc})") from None
    if size != HEADER_BYTES + 4 * _words(n, p) or len(head) != _HEAD.size:
        raise MomentsFileError(f"{path} has {size} bytes, not the expected layout's")
    magic, version, _, token, fn, fp, c1, c2, fnames = _HEAD.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise MomentsFileError(f"{path} is not a moments file of version {VERSION}")
    if (token, fn, fp) != want or (c1, c2) != checks:
        raise MomentsFileError(f"{path} is not the file this node wrote last (token or header)")
    if fnames != names:
        raise MomentsFileError(f"{path} was written for other parameter names or shapes")
    values = _map(path, n, p)
    if checksums(values) != checks:
        raise MomentsFileError(f"{path}: values do not match their checksum (damaged)")
    steps = views(values, n, p)["step"]
    if (
        not bool(torch.isfinite(steps).all())
        or bool((steps < 0).any())
        or bool((steps != steps.round()).any())
    ):
        raise MomentsFileError(f"{path}: steps are not integers >= 0")
    return values, token


# ----------------------------------------------------------------------------- the optimiser
MOMENTS_DIR_KEY = "node-state.moments-dir"
"""ConfigRecord ``{"dir": folder}`` in ``context.state`` while a handler runs: the node's
private folder where the worker keeps its moments file (set by
:func:`~flwr_isoloco.clients.node_state.with_node_state` when it keeps no state to resume from)."""

_MAPPED: dict[str, tuple[int, torch.Tensor]] = {}  # path -> (inode, values) mapped here


def _mapped(path: Path) -> torch.Tensor | None:
    """This process's mapping of ``path`` if it is of the file there now (same inode)."""
    entry = _MAPPED.get(str(path))
    try:
        return entry[1] if entry is not None and path.stat().st_ino == entry[0] else None
    except OSError:
        return None


def _remember(path: Path, values: torch.Tensor) -> torch.Tensor:
    _MAPPED[str(path)] = (path.stat().st_ino, values)
    return values


def forget_mappings() -> None:
    """Drop this process's mappings (the files stay)."""
    _MAPPED.clear()


def moments_path(state, node_config, node_id: int) -> Path | None:
    """``<dir>/adamw-p<partition-id>-n<node_id>.moments`` when ``state`` holds
    :data:`MOMENTS_DIR_KEY`, else None."""
    rec = state.get(MOMENTS_DIR_KEY)
    if rec is None or "dir" not in rec:
        return None
    pid = node_config.get("partition-id", "-")
    return Path(str(rec["dir"])) / f"adamw-p{pid}-n{int(node_id)}.moments"


def _sizes(named) -> tuple[int, int]:
    return sum(p.numel() for _, p in named), len(named)


def attach(opt: torch.optim.Optimizer, named, h) -> None:
    """Restore ``opt``'s state from the file of handle ``h`` (checked: :func:`open_verified`).
    Moments of fp32 parameters on the CPU become views of the mapping (no copy); others are
    copied to their parameter's device and dtype. A parameter with step 0 gets no state."""
    from .adamw_state import _step_tensor

    n, p = _sizes(named)
    values, _token = open_verified(h, names_digest(named), n, p)
    _remember(Path(str(h["path"])), values)
    v, off, restored = views(values, n, p), 0, {}
    for i, (_, prm) in enumerate(named):
        k, step = prm.numel(), float(v["step"][i])
        if step > 0:
            st = {"step": _step_tensor(opt, prm, step)}
            for m in ("exp_avg", "exp_avg_sq"):
                t = v[m][off : off + k].view(prm.shape)
                shared = prm.device.type == "cpu" and prm.dtype == torch.float32
                st[m] = t if shared else t.to(prm.device, prm.dtype, copy=True)
            restored[prm] = st
        off += k
    for prm, st in restored.items():
        opt.state[prm] = st


def store(opt: torch.optim.Optimizer, named, path: Path, token: bytes) -> dict:
    """Write ``opt``'s state for ``named`` to the file at ``path`` and seal it; returns its
    :func:`handle`. Moments that are already views of this process's mapping of ``path`` are
    not copied; others are copied in, and on the CPU (fp32) become views of it from now on."""
    n, p = _sizes(named)
    values = _mapped(path)
    if values is None or values.numel() != _words(n, p):
        values = _remember(path, create(path, n, p))
    v, off = views(values, n, p), 0
    for i, (_, prm) in enumerate(named):
        st, k = opt.state.get(prm) or {}, prm.numel()
        for m in ("exp_avg", "exp_avg_sq"):
            slot, t = v[m][off : off + k], st.get(m)
            if t is None:
                slot.zero_()
            elif t.data_ptr() != slot.data_ptr() or t.device != slot.device:
                slot.copy_(t.detach().reshape(-1))
                if t.device.type == "cpu" and t.dtype == torch.float32:
                    st[m] = slot.view(prm.shape)
        v["step"][i] = float(st["step"]) if "step" in st else 0.0
        off += k
    checks = seal(path, values, n, p, token, names_digest(named))
    return handle(path, token, n, p, checks)
