"""ClientApp: a DiLoCo worker (H inner AdamW steps on the node's contiguous text shard, or on
its own text).

The training loop is :func:`flwr_isoloco.clients.make_diloco_train_handler`; this module only
supplies the model, the node's batches, and the node-state files that make ``resume-from``
exact (see ``task.py``). The node's shard is ``partition-id`` of ``num-partitions`` from its
``node_config`` (set by the simulation engine, or ``--node-config`` in deployment). A node whose
``node_config`` has a non-empty ``data-path`` (absolute path to a .txt/.md file or a folder of
them) trains on all of that text instead, encoded with the run's tokenizer; if the path cannot
be used the node logs why and replies with an error (the server drops it, the run goes on).
"""

from __future__ import annotations

from logging import ERROR, WARNING
from pathlib import Path

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from flwr_isoloco.clients.diloco_worker import ADAMW_STATE_KEY, make_diloco_train_handler

from .task import (
    DATA_PATH_KEY,
    RESUME_DIR_KEY,
    RESUME_ROUND_KEY,
    STATE_DIR_KEY,
    NodeDataError,
    build_model,
    load_config,
    local_batches,
    node_batches,
    restore_node_state,
    save_node_state,
)

app = ClientApp()


def _partition(context: Context) -> tuple[int, int]:
    nc = context.node_config
    try:
        return int(nc["partition-id"]), int(nc["num-partitions"])
    except KeyError as exc:
        raise ValueError(
            f"node_config lacks {exc.args[0]!r} (set --node-config 'partition-id=.. num-partitions=..')"
        ) from None


def _state_folder(context: Context, conf, key: str) -> Path | None:
    """Where this node keeps its state files: ``--node-config "state-dir='/abs/dir'"`` if the
    node sets it (deployment: a node-local disk), else the folder the server suggests."""
    local = context.node_config.get("state-dir")
    if local:
        return Path(str(local))
    return Path(str(conf[key])) if key in conf else None


def train(msg: Message, context: Context) -> Message:
    cfg = load_config(context.run_config)
    torch.set_num_threads(cfg["torch-threads"])
    pid, parts = _partition(context)
    conf = msg.content.config_records.get("config", {})
    rnd = int(conf.get("server-round", 0))
    if ADAMW_STATE_KEY not in context.state and RESUME_ROUND_KEY in conf:
        folder = _state_folder(context, conf, RESUME_DIR_KEY)
        try:
            if folder is None:
                raise ValueError("no state folder given")
            got = restore_node_state(context.state, folder, pid, int(conf[RESUME_ROUND_KEY]))
            if got is None:
                log(
                    WARNING,
                    "node p%d: no saved state in %s; starting a fresh optimiser",
                    pid,
                    folder,
                )
        except (OSError, ValueError) as exc:  # a damaged file must not stop training
            log(
                WARNING,
                "node p%d: cannot restore state from %s (%s); fresh optimiser",
                pid,
                folder,
                exc,
            )
    data_path = str(context.node_config.get(DATA_PATH_KEY, "") or "")
    if data_path:
        try:
            own = local_batches(cfg, data_path, pid)
        except NodeDataError as exc:
            log(ERROR, "isoloco-lm: %s", exc)  # the error reply's reason says it to the server
            raise

        def data_fn(ctx):
            return own
    else:

        def data_fn(ctx):
            return node_batches(cfg, pid, parts)

    handler = make_diloco_train_handler(lambda ctx: build_model(cfg), data_fn, seed=cfg.seed)
    reply = handler(msg, context)
    folder = _state_folder(context, conf, STATE_DIR_KEY) if STATE_DIR_KEY in conf else None
    if folder is not None:
        try:
            save_node_state(context.state, folder, pid, rnd)
        except (OSError, ValueError) as exc:  # the reply matters more than the state file
            log(
                WARNING,
                "node p%d: cannot save state to %s (%s); the reply is sent anyway",
                pid,
                folder,
                exc,
            )
    return reply


app.train()(train)
