"""Client state that survives a server restart: one mechanism for every flwr-isoloco client.

A node's ``context.state`` (the DiLoCo worker's AdamW moments and data cursor, the LoRA
client's data cursor) lives only as long as the run. To make ``resume-from`` exact, a train
handler wrapped by :func:`with_node_state` writes the node's whole ``context.state`` after
every train round it serves to ``<dir>/node-p<partition-id>-r<round>.safetensors`` (keeping
its last two), and a node of a resumed run whose state is empty first reads the newest file at
or before the checkpoint's round. The server names the folders and the round in the train
config (:data:`STATE_DIR_KEY`, :data:`RESUME_DIR_KEY`, :data:`RESUME_ROUND_KEY`; see
:func:`flwr_isoloco.apprunner.node_state_config`); a node that sets
``--node-config "state-dir='/abs/dir'"`` (deployment: a node-local disk) uses that folder
instead. Files are checkpoints (:mod:`flwr_isoloco.checkpoint`): verified on reading, and a
damaged or missing file costs that node its state (logged), never the reply.

Off the server's process: in a Ray simulation every node's ``context.state`` is held by the
process that also runs the ServerApp, so M workers' AdamW moments (2 fp32 copies of the model
each) would pile up there. Once a round's file is written, the wrapper therefore drops the
state's ArrayRecords from ``context.state`` and keeps only a handle, ConfigRecord
:data:`HANDLE_KEY` = ``{path, round, digest}`` (``digest``: sha256 of the file's digest header,
:func:`file_digest`); the small Config/MetricRecords (data cursor) stay. The next train round
reads the ArrayRecords back from that file before the handler runs: verified as any checkpoint,
and its partition, round and digest must be the handle's. A file that is missing, damaged or
not the one written costs the node its ArrayRecords (a fresh optimiser, logged); the reply is
still sent. A file that cannot be written leaves the state in memory (logged). With no folder
(the server sends no :data:`STATE_DIR_KEY` and the node sets no ``state-dir``), the handler
runs unchanged and the state stays in ``context.state``: no files appear where nobody asked
for them; pass ``default_dir=`` to :func:`with_node_state` to keep them on a disk anyway,
``temp_dir=True`` to keep them in this machine's private per-run folder :func:`run_temp_dir`
(only the newest file per node: nothing to resume from; the ServerApp removes the folder at the
end of the run with :func:`remove_run_temp_dir`, which in a simulation is every node's), or
``offload=False`` to keep the files but the state in memory as well.

In that temp folder the DiLoCo worker keeps its AdamW moments in a file of its own
(:mod:`flwr_isoloco.clients.moments_file`, written by a background thread while the message
replies; the folder reaches it as :data:`~flwr_isoloco.clients.moments_file.MOMENTS_DIR_KEY` in
``context.state`` while the handler runs) and ``context.state`` only the file's handle, so the
node-state file of a round holds kilobytes, not two copies of the model: no file is hashed with
sha256 or read back in full per message, and the moments file is checked with checksums when a
process without the moments in memory reads it. Where there is a state to resume from (a
server's or the node's folder) the moments stay in the node-state files, which are the resume
checkpoints.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Mapping
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.common.logger import log
from safetensors import safe_open

from flwr_isoloco.checkpoint import (
    RECORDS_FIELD,
    Field,
    checkpoint_error,
    load_checkpoint,
    recorddict_to_tree,
    restoring,
    save_checkpoint,
    tree_to_recorddict,
)
from flwr_isoloco.clients.moments_file import MOMENTS_DIR_KEY

__all__ = [
    "HANDLE_KEY",
    "NODE_STATE",
    "RESUME_DIR_KEY",
    "RESUME_ROUND_KEY",
    "STATE_DIR_KEY",
    "file_digest",
    "load_state_file",
    "remove_run_temp_dir",
    "run_temp_dir",
    "restore_node_state",
    "save_node_state",
    "with_node_state",
]

STATE_DIR_KEY = "node-state-dir"
RESUME_DIR_KEY = "resume-node-state-dir"
RESUME_ROUND_KEY = "resume-round"
LOCAL_DIR_KEY = "state-dir"  # node_config key: the node's own folder (overrides the server's)
NODE_STATE = "node-state"  # the ``app`` (kind) of a node-state file
HANDLE_KEY = "node-state.file"  # ConfigRecord in context.state: where the ArrayRecords went
NODE_STATE_SPEC = {
    "partition-id": Field("int", min=0),
    "round": Field("int", min=0),
    "records": RECORDS_FIELD,
}
_STATE_FILE = re.compile(r"node-p(\d+)-r(\d+)\.safetensors$")


def _state_files(folder: Path, partition_id: int) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        m = _STATE_FILE.match(p.name)
        if m and int(m.group(1)) == partition_id:
            out.append((int(m.group(2)), p))
    return sorted(out)


def save_node_state(
    state, folder: Path, partition_id: int, server_round: int, keep: int = 2
) -> Path:
    """Write ``state`` (a RecordDict) to this node's file for ``server_round``; keep the last
    ``keep`` files; returns the file. The meta names the kind, partition and round (checked on
    reading)."""
    tensors, meta = recorddict_to_tree(state)
    path = folder / f"node-p{partition_id}-r{server_round}.safetensors"
    save_checkpoint(
        path,
        tensors,
        {"app": NODE_STATE, "partition-id": partition_id, "round": server_round, "records": meta},
    )
    for _, old in _state_files(folder, partition_id)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def run_temp_dir(run_id: int, create: bool = True) -> Path:
    """``<system temp>/flwr-isoloco-<uid>/node-state-run<run_id>``: this machine's folder for
    the node-state files of run ``run_id`` when nobody configured one. The parent is made
    private (mode 0700) and must be a folder of this user that no one else can write (not a
    link), else ``OSError``: a shared temp folder is no place to trust a fixed name."""
    root = Path(tempfile.gettempdir()) / f"flwr-isoloco-{os.getuid()}"
    if create:
        root.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f"{root} is not a private folder of this user")
    return root / f"node-state-run{int(run_id)}"


def remove_run_temp_dir(run_id: int) -> None:
    """Remove :func:`run_temp_dir` of ``run_id`` with every file in it (idempotent)."""
    try:
        folder = run_temp_dir(run_id, create=False)
    except OSError:
        return
    shutil.rmtree(folder, ignore_errors=True)


def file_digest(path: Path) -> str:
    """sha256 of a checkpoint's ``digest`` header entry (which holds the sha256 of its meta and
    of every tensor): names the file's content after reading only its header."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            header = (fh.metadata() or {}).get("digest", "")
    except Exception as exc:  # safetensors raises its own error types on bad files
        raise checkpoint_error(path, f"header unreadable ({exc})") from None
    return hashlib.sha256(header.encode("utf-8")).hexdigest()


def load_state_file(path: Path, partition_id: int, server_round: int):
    """The RecordDict of one node-state file, verified
    (:func:`~flwr_isoloco.checkpoint.load_checkpoint` with kind ``node-state`` and
    :data:`NODE_STATE_SPEC`); its partition and round must be the given ones. Any problem is a
    ``CheckpointError`` naming the file and field."""
    tensors, meta = load_checkpoint(path, kind=NODE_STATE, spec=NODE_STATE_SPEC)
    for field, want in (("partition-id", partition_id), ("round", server_round)):
        if meta[field] != want:
            raise checkpoint_error(
                path, f"field {field!r} is {meta[field]!r}, the name says {want}"
            )
    with restoring(path):
        return tree_to_recorddict(tensors, meta["records"])


def restore_node_state(state, folder: Path, partition_id: int, upto_round: int) -> int | None:
    """Fill an empty ``state`` from the newest file of this node at round <= ``upto_round``;
    returns that round, or None when there is no such file.

    The file is checked by :func:`load_state_file`; on any problem (a ``CheckpointError``
    naming the file and field) ``state`` is left untouched.
    """
    files = [(r, p) for r, p in _state_files(folder, partition_id) if r <= upto_round]
    if not files:
        return None
    rnd, path = files[-1]
    for key, rec in load_state_file(path, partition_id, rnd).items():
        state[key] = rec
    return rnd


def _folder(context: Context, conf: Mapping[str, Any], key: str) -> Path | None:
    """The node's own ``state-dir`` if its node_config sets one, else the server's suggestion."""
    local = context.node_config.get(LOCAL_DIR_KEY)
    if local:
        return Path(str(local))
    return Path(str(conf[key])) if key in conf else None


def _restore(context: Context, conf: Mapping[str, Any], pid: int) -> None:
    folder = _folder(context, conf, RESUME_DIR_KEY)
    try:
        if folder is None:
            raise ValueError("no state folder given")
        if restore_node_state(context.state, folder, pid, int(conf[RESUME_ROUND_KEY])) is None:
            log(WARNING, "node p%d: no saved state in %s; starting fresh", pid, folder)
    except (OSError, ValueError) as exc:  # a damaged file must not stop training
        log(
            WARNING, "node p%d: cannot restore state from %s (%s); starting fresh", pid, folder, exc
        )


def _save(context: Context, folder: Path, rnd: int, pid: int, keep: int = 2) -> Path | None:
    try:
        return save_node_state(context.state, folder, pid, rnd, keep=keep)
    except (OSError, ValueError) as exc:  # the reply matters more than the state file
        log(WARNING, "node p%d: cannot save state to %s (%s); reply sent anyway", pid, folder, exc)
        return None


def _drop_arrays(context: Context, handle: ConfigRecord) -> None:
    """Keep only ``handle`` in place of the ArrayRecords of ``context.state``."""
    for key in [k for k, rec in context.state.items() if isinstance(rec, ArrayRecord)]:
        del context.state[key]
    context.state[HANDLE_KEY] = handle


def _offload(context: Context, path: Path, rnd: int, pid: int) -> None:
    """Drop the ArrayRecords of ``context.state`` (now in ``path``) and keep a handle to them."""
    try:
        digest = file_digest(path)
    except ValueError as exc:
        log(WARNING, "node p%d: state file %s unreadable (%s); kept in memory", pid, path, exc)
        return
    _drop_arrays(context, ConfigRecord({"path": str(path), "round": rnd, "digest": digest}))


def _reload(context: Context, pid: int) -> ConfigRecord | None:
    """Take the handle out of ``context.state`` and read its ArrayRecords back; returns the
    handle (None without one). A file that fails any check costs only those records."""
    handle = context.state.get(HANDLE_KEY)
    if handle is None:
        return None
    del context.state[HANDLE_KEY]
    path = handle.get("path") if isinstance(handle, ConfigRecord) else None
    try:
        if not isinstance(handle, ConfigRecord):
            raise ValueError(f"{HANDLE_KEY!r} is a {type(handle).__name__}, not a ConfigRecord")
        path, rnd, want = Path(str(handle["path"])), int(handle["round"]), str(handle["digest"])
        if file_digest(path) != want:
            raise checkpoint_error(path, "digest is not the one this node wrote (file replaced)")
        records = load_state_file(path, pid, rnd)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log(
            WARNING,
            "node p%d: cannot read its state back from %s (%s); its optimiser starts fresh",
            pid,
            path,
            exc,
        )
        return None
    for key, rec in records.items():
        if isinstance(rec, ArrayRecord):
            context.state[key] = rec
    return handle


def _temp_folder(context: Context, pid: object) -> tuple[Path | None, int]:
    """(folder, files kept) for ``temp_dir``: the node's ``state-dir`` if it sets one (keep 2),
    else :func:`run_temp_dir` (keep 1: no checkpoint to resume from, only the state the next
    round reads); None when the temp folder is unusable (logged: the state stays in memory)."""
    local = context.node_config.get(LOCAL_DIR_KEY)
    if local:
        return Path(str(local)), 2
    try:
        return run_temp_dir(context.run_id), 1
    except OSError as exc:
        log(WARNING, "node p%s: no private temp folder (%s); state kept in memory", pid, exc)
        return None, 2


def with_node_state(
    train: Callable[[Message, Context], Message],
    *,
    config_key: str = "config",
    partition_key: str = "partition-id",
    offload: bool = True,
    default_dir: str | Path | None = None,
    temp_dir: bool = False,
) -> Callable[[Message, Context], Message]:
    """Wrap a ``@app.train`` handler so the node's ``context.state`` is restored on a resumed
    run, saved after each round and, with ``offload``, kept on disk between rounds (module
    docstring). The folder: the node's ``state-dir``, else the server's :data:`STATE_DIR_KEY`,
    else ``default_dir``, else with ``temp_dir`` :func:`run_temp_dir` (newest file only); with
    none of them (or no ``partition-id``) the handler runs unchanged."""

    def handler(msg: Message, context: Context) -> Message:
        conf = msg.content.config_records.get(config_key, {})
        pid = context.node_config.get(partition_key)
        folder = _folder(context, conf, STATE_DIR_KEY) if STATE_DIR_KEY in conf else None
        if folder is None and default_dir is not None:
            folder = _folder(context, {STATE_DIR_KEY: default_dir}, STATE_DIR_KEY)
        keep = 2
        if folder is None and temp_dir and pid is not None:
            folder, keep = _temp_folder(context, pid)
        offloaded = HANDLE_KEY in context.state
        if pid is None or (folder is None and RESUME_ROUND_KEY not in conf and not offloaded):
            return train(msg, context)
        pid = int(pid)
        handle = _reload(context, pid)
        if not offloaded and RESUME_ROUND_KEY in conf and len(context.state) == 0:
            _restore(context, conf, pid)
        if keep == 1 and folder is not None:  # nothing to resume from: a moments file there
            context.state[MOMENTS_DIR_KEY] = ConfigRecord({"dir": str(folder)})
        try:
            reply = train(msg, context)
        except BaseException:
            if handle is not None:  # nothing was saved: the old file still holds the state
                _drop_arrays(context, handle)
            raise
        finally:
            if MOMENTS_DIR_KEY in context.state:
                del context.state[MOMENTS_DIR_KEY]
        if reply.has_error():
            if handle is not None:
                _drop_arrays(context, handle)
            return reply
        rnd = int(conf.get("server-round", 0))
        path = _save(context, folder, rnd, pid, keep) if folder is not None else None
        if offload and path is not None:
            _offload(context, path, rnd, pid)
        return reply

    handler.__name__ = getattr(train, "__name__", "train")
    handler.__doc__ = train.__doc__
    return handler
