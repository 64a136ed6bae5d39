"""The DiLoCo worker's AdamW moments in a file on the node's disk, written in the background.

Layout: a 4096-byte header, then three segments, each zero-padded to whole rows of :data:`ROW`
int64 words: ``exp_avg`` (N fp32), ``exp_avg_sq`` (N fp32) and ``step`` (P fp32), for N
trainable values in P parameters (the flat layout of
:func:`~flwr_isoloco.clients.adamw_state.adamw_to_flat`).

Writing (:func:`store`, when a message ends): the moments stay where AdamW keeps them (the
process's cache holds them for its next message); the file gets a copy, made while the message
builds its reply and returns:

1. in the caller's thread, an exclusive ``flock`` on the file and a header that says a write is
   under way (a token of zeros): until step 2 ends, any reader refuses the file;
2. in a background thread, the moments are copied into the file (``pwrite``, from the device
   first on a GPU), their checksums computed, and the header written with this message's token
   and the checksums; then the lock is released.

The next message of this process waits for that thread before AdamW touches the moments
(:func:`wait_writes`), the process waits for it before it exits (the thread is not a daemon, and
a Flower ClientApp process runs :func:`wait_writes` among its exit handlers, before its forced
exit), and a reader in another process waits on the lock. AdamW never runs on the file itself: on a file
mapping the kernel's write-back makes every re-dirtied page fault (AdamW measured 14 % slower
while the file was being written back), and a message that failed half-way would leave moments
that belong to no round. Here the file always holds the last completed message's moments, so a
retry after a failure resumes exactly.

Reading (:func:`attach`, a process without the node's moments in its cache: a fresh ClientApp
process, another Ray actor): the file is hostile until these checks pass, in order, else
:class:`MomentsFileError` names the first that failed: its size for N and P, magic and version,
a completed write, the token ``context.state``'s handle holds (the file this node wrote last),
the digest of the parameter names and shapes, the checksums recomputed over every value word, and
steps that are integers >= 0. The checksums, over each segment's int64 words ``w`` in rows of
``ROW`` words, row ``r`` counted across the segments::

    s_r    = sum of the words of row r
    check1 = sum_r s_r                         (sums and products modulo 2^64)
    check2 = sum_r s_r * (r mod 524_287 + 1)

``check1`` changes with any single changed word; ``check2`` when rows are swapped. Both are one
pass over the values (~0.1 s per GB on a CPU core, against ~2 s for sha256); they detect damage
and stale or foreign files, not a forger with write access to the node's private folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import threading
from collections.abc import Sequence
from logging import WARNING
from pathlib import Path

import torch
from flwr.common.logger import log

__all__ = [
    "HEADER_BYTES",
    "MOMENTS_DIR_KEY",
    "ROW",
    "MomentsFileError",
    "attach",
    "checksums",
    "moments_path",
    "names_digest",
    "store",
    "wait_writes",
]

MAGIC = b"FLWRISOM"
VERSION = 2
HEADER_BYTES = 4096
ROW = 512  # int64 words per checksum row
_HEAD = struct.Struct("<8sII16sQQqq32s")  # magic, version, 0, token, N, P, check1, check2, names
_WRITING = bytes(16)  # the token of a file whose write has not completed

MOMENTS_DIR_KEY = "node-state.moments-dir"
"""ConfigRecord ``{"dir": folder}`` in ``context.state`` while a handler runs: the node's private
folder for its moments file (set by :func:`~flwr_isoloco.clients.node_state.with_node_state`
when it keeps no state to resume from)."""


class MomentsFileError(ValueError):
    """A moments file that must not be used (the message says which check failed)."""


def names_digest(named: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """sha256 of the trainable parameters' names and shapes, in order."""
    h = hashlib.sha256()
    for name, p in named:
        h.update(f"{name}:{tuple(p.shape)};".encode())
    return h.digest()


def _rows(count: int) -> int:
    """Rows of ROW int64 words that ``count`` fp32 values fill (the last one padded)."""
    return -(-count // (2 * ROW))


def _layout(n: int, p: int) -> list[tuple[str, int, int]]:
    """``(segment, fp32 values, first row)`` of the three segments."""
    out, row = [], 0
    for name, count in (("exp_avg", n), ("exp_avg_sq", n), ("step", p)):
        out.append((name, count, row))
        row += _rows(count)
    return out


def _file_bytes(n: int, p: int) -> int:
    return HEADER_BYTES + 8 * ROW * sum(_rows(c) for _, c, _ in _layout(n, p))


def checksums(segments: Sequence[tuple[torch.Tensor, int]]) -> tuple[int, int]:
    """``(check1, check2)`` of fp32 segments ``(values, first row)`` on the CPU, each counted as
    if zero-padded to whole rows (module docstring)."""
    c1 = c2 = 0
    for values, row0 in segments:
        flat = values.reshape(-1)
        whole = (flat.numel() // (2 * ROW)) * 2 * ROW
        sums = [flat[:whole].view(torch.int64).reshape(-1, ROW).sum(dim=1)]
        if whole < flat.numel():
            tail = torch.zeros(2 * ROW, dtype=torch.float32)
            tail[: flat.numel() - whole] = flat[whole:]
            sums.append(tail.view(torch.int64).sum().reshape(1))
        s = torch.cat(sums)
        weight = torch.arange(row0, row0 + s.numel(), dtype=torch.int64) % 524_287 + 1
        c1 += int(s.sum())
        c2 += int((s * weight).sum())
    return c1 % 2**64, c2 % 2**64


def _header(token: bytes, n: int, p: int, checks: tuple[int, int], names: bytes) -> bytes:
    c1, c2 = (c - 2**64 if c >= 2**63 else c for c in checks)
    return _HEAD.pack(MAGIC, VERSION, 0, token, n, p, c1, c2, names).ljust(HEADER_BYTES, b"\0")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


# ----------------------------------------------------------------------------- writing
_PENDING: list[threading.Thread] = []
_FAILED: list[str] = []
_EXIT_HOOK: list[bool] = []


def _hook_exit() -> None:
    """Make a Flower ClientApp process wait for the write before it exits: ``flwr_exit``
    kills the process 5 s after it starts exiting, but runs these handlers first. (Elsewhere the
    thread, not a daemon, holds the interpreter open until it is done.)"""
    if _EXIT_HOOK:
        return
    _EXIT_HOOK.append(True)
    try:
        from flwr.supercore.exit.exit_handler import add_exit_handler
    except ImportError:
        return
    add_exit_handler(wait_writes, run_before_force_exit=True)


def wait_writes() -> None:
    """Wait until this process's background writes are done (a failed one is logged: its file
    stays marked as being written, so the next reader refuses it)."""
    while _PENDING:
        _PENDING.pop(0).join()
    while _FAILED:
        log(WARNING, "DiLoCo worker: moments file not written (%s)", _FAILED.pop(0))


def _write(fd: int, flat: dict, n: int, p: int, token: bytes, names: bytes, path: Path) -> None:
    try:
        segments = []
        for name, count, row0 in _layout(n, p):
            t = flat[name].detach().reshape(-1).to("cpu", torch.float32).contiguous()
            assert t.numel() == count
            _pwrite_all(fd, memoryview(t.numpy()).cast("B"), HEADER_BYTES + row0 * ROW * 8)
            segments.append((t, row0))
        _pwrite_all(fd, memoryview(_header(token, n, p, checksums(segments), names)), 0)
    except Exception as exc:  # noqa: BLE001 - reported by wait_writes; the file stays refused
        _FAILED.append(f"{path}: {type(exc).__name__}: {exc}")
    finally:
        os.close(fd)  # releases the lock


def _open_for_write(path: Path, n: int, p: int) -> int:
    """The file at ``path``, (re)made at the layout's size (private, mode 0600), opened and
    locked exclusively, its header marked as being written."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    size = _file_bytes(n, p)
    try:
        same = path.stat().st_size == size
    except FileNotFoundError:
        same = False
    if not same:
        tmp = path.with_name(path.name + ".new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _pwrite_all(fd, memoryview(_header(_WRITING, n, p, (0, 0), bytes(32))), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def store(opt: torch.optim.Optimizer, named, path: Path, token: bytes) -> dict:
    """Start writing ``opt``'s state for ``named`` to the file at ``path`` (module docstring);
    returns the handle ``context.state`` keeps: ``{path, token, numel, params}``."""
    from .adamw_state import adamw_to_flat

    wait_writes()
    n, p = sum(q.numel() for _, q in named), len(named)
    flat = adamw_to_flat(opt, named, share=True)  # on fp32 moments: their own buffers, no copy
    fd = _open_for_write(path, n, p)
    args = (fd, flat, n, p, token, names_digest(named), path)
    thread = threading.Thread(target=_write, args=args, name="moments-file-writer")
    _hook_exit()
    thread.start()
    _PENDING.append(thread)
    return {"path": str(path), "token": token.hex(), "numel": n, "params": p}


# ----------------------------------------------------------------------------- reading
def _check_header(path: Path, head: bytes, want: tuple, names: bytes) -> tuple[int, int]:
    magic, version, _, token, fn, fp, c1, c2, fnames = _HEAD.unpack(head[: _HEAD.size])
    if magic != MAGIC or version != VERSION:
        raise MomentsFileError(f"{path} is not a moments file of version {VERSION}")
    if token == _WRITING:
        raise MomentsFileError(f"{path}: its last write did not complete")
    if (token, fn, fp) != want:
        raise MomentsFileError(f"{path} is not the file this node wrote last (token or sizes)")
    if fnames != names:
        raise MomentsFileError(f"{path} was written for other parameter names or shapes")
    return c1 % 2**64, c2 % 2**64


def read_verified(h, names: bytes, n: int, p: int) -> dict[str, torch.Tensor]:
    """``exp_avg``, ``exp_avg_sq``, ``step`` of the file that handle ``h`` names, read into
    memory after every check of the module docstring (:class:`MomentsFileError` otherwise)."""
    try:
        path = Path(str(h["path"]))
        want = (bytes.fromhex(str(h["token"])), int(h["numel"]), int(h["params"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise MomentsFileError(f"handle unreadable ({exc})") from None
    if want[1:] != (n, p):
        raise MomentsFileError(
            f"handle is for {want[1]} values / {want[2]} parameters, not {n} / {p}"
        )
    wait_writes()
    try:
        with open(path, "rb") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_SH)  # a writer in another process finishes first
            size = os.fstat(fh.fileno()).st_size
            if size != _file_bytes(n, p):
                raise MomentsFileError(f"{path} has {size} bytes, not the layout's")
            checks = _check_header(path, fh.read(HEADER_BYTES), want, names)
            out, segments = {}, []
            for name, count, row0 in _layout(n, p):  # one buffer each: AdamW's flat moments
                out[name] = torch.empty(count, dtype=torch.float32)
                fh.seek(HEADER_BYTES + row0 * ROW * 8)
                if fh.readinto(memoryview(out[name].numpy()).cast("B")) != 4 * count:
                    raise MomentsFileError(f"{path} ended early")
                segments.append((out[name], row0))
    except OSError as exc:
        raise MomentsFileError(f"{path} unreadable ({exc})") from None
    if checksums(segments) != checks:
        raise MomentsFileError(f"{path}: values do not match their checksum (damaged)")
    s = out["step"]
    if not bool(torch.isfinite(s).all()) or bool((s < 0).any()) or bool((s != s.round()).any()):
        raise MomentsFileError(f"{path}: steps are not integers >= 0")
    return out


def attach(opt: torch.optim.Optimizer, named, h) -> None:
    """Restore ``opt``'s state from the file of handle ``h`` (:func:`read_verified`). On the CPU
    the moments of fp32 parameters are views of the two buffers read (no further copy, and the
    flat buffers :func:`~.adamw_state.adamw_to_flat` hands to the next :func:`store` without
    one); others are copied to their parameter's device and dtype. A parameter with step 0 gets
    no state."""
    from .adamw_state import _step_tensor

    n, p = sum(q.numel() for _, q in named), len(named)
    v = read_verified(h, names_digest(named), n, p)
    restored, off = {}, 0
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


def moments_path(state, node_config, node_id: int) -> Path | None:
    """``<dir>/adamw-p<partition-id>-n<node_id>.moments`` when ``state`` holds
    :data:`MOMENTS_DIR_KEY`, else None."""
    rec = state.get(MOMENTS_DIR_KEY)
    if rec is None or "dir" not in rec:
        return None
    pid = node_config.get("partition-id", "-")
    return Path(str(rec["dir"])) / f"adamw-p{pid}-n{int(node_id)}.moments"
