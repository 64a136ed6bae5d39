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
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.common.logger import log

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

__all__ = [
    "NODE_STATE",
    "RESUME_DIR_KEY",
    "RESUME_ROUND_KEY",
    "STATE_DIR_KEY",
    "restore_node_state",
    "save_node_state",
    "with_node_state",
]

STATE_DIR_KEY = "node-state-dir"
RESUME_DIR_KEY = "resume-node-state-dir"
RESUME_ROUND_KEY = "resume-round"
LOCAL_DIR_KEY = "state-dir"  # node_config key: the node's own folder (overrides the server's)
NODE_STATE = "node-state"  # the ``app`` (kind) of a node-state file
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
) -> None:
    """Write ``state`` (a RecordDict) to this node's file for ``server_round``; keep the last
    ``keep`` files. The meta names the kind, partition and round (checked on reading)."""
    tensors, meta = recorddict_to_tree(state)
    save_checkpoint(
        folder / f"node-p{partition_id}-r{server_round}.safetensors",
        tensors,
        {"app": NODE_STATE, "partition-id": partition_id, "round": server_round, "records": meta},
    )
    for _, old in _state_files(folder, partition_id)[:-keep]:
        old.unlink(missing_ok=True)


def restore_node_state(state, folder: Path, partition_id: int, upto_round: int) -> int | None:
    """Fill an empty ``state`` from the newest file of this node at round <= ``upto_round``;
    returns that round, or None when there is no such file.

    The file is verified (:func:`~flwr_isoloco.checkpoint.load_checkpoint` with kind
    ``node-state`` and :data:`NODE_STATE_SPEC`) and its partition and round must be those of
    its name; any problem is a ``CheckpointError`` naming the file and field, and ``state`` is
    left untouched.
    """
    files = [(r, p) for r, p in _state_files(folder, partition_id) if r <= upto_round]
    if not files:
        return None
    rnd, path = files[-1]
    tensors, meta = load_checkpoint(path, kind=NODE_STATE, spec=NODE_STATE_SPEC)
    for field, want in (("partition-id", partition_id), ("round", rnd)):
        if meta[field] != want:
            raise checkpoint_error(
                path, f"field {field!r} is {meta[field]!r}, the name says {want}"
            )
    with restoring(path):
        records = tree_to_recorddict(tensors, meta["records"])
    for key, rec in records.items():
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


def _save(context: Context, conf: Mapping[str, Any], pid: int) -> None:
    folder = _folder(context, conf, STATE_DIR_KEY) if STATE_DIR_KEY in conf else None
    if folder is None:
        return
    try:
        save_node_state(context.state, folder, pid, int(conf.get("server-round", 0)))
    except (OSError, ValueError) as exc:  # the reply matters more than the state file
        log(WARNING, "node p%d: cannot save state to %s (%s); reply sent anyway", pid, folder, exc)


def with_node_state(
    train: Callable[[Message, Context], Message],
    *,
    config_key: str = "config",
    partition_key: str = "partition-id",
) -> Callable[[Message, Context], Message]:
    """Wrap a ``@app.train`` handler so the node's ``context.state`` is restored on a resumed
    run and saved after each round (module docstring). Without the server's keys in the
    message's ConfigRecord ``config_key`` the handler runs unchanged."""

    def handler(msg: Message, context: Context) -> Message:
        conf = msg.content.config_records.get(config_key, {})
        pid = context.node_config.get(partition_key)
        keyed = STATE_DIR_KEY in conf or RESUME_ROUND_KEY in conf
        if pid is None or not keyed:
            return train(msg, context)
        pid = int(pid)
        if RESUME_ROUND_KEY in conf and len(context.state) == 0:
            _restore(context, conf, pid)
        reply = train(msg, context)
        if not reply.has_error():
            _save(context, conf, pid)
        return reply

    handler.__name__ = getattr(train, "__name__", "train")
    handler.__doc__ = train.__doc__
    return handler
