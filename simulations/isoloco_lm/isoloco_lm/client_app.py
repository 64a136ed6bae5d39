"""ClientApp: a DiLoCo worker (H inner AdamW steps on the node's contiguous text shard).

The training loop is :func:`flwr_isoloco.clients.make_diloco_train_handler`; this module only
supplies the model, the node's batches, and the node-state files that make ``resume-from``
exact (see ``task.py``). The node's shard is ``partition-id`` of ``num-partitions`` from its
``node_config`` (set by the simulation engine, or ``--node-config`` in deployment).
"""

from __future__ import annotations

from pathlib import Path

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from flwr_isoloco.clients.diloco_worker import ADAMW_STATE_KEY, make_diloco_train_handler

from .task import (
    RESUME_DIR_KEY,
    RESUME_ROUND_KEY,
    STATE_DIR_KEY,
    build_model,
    load_config,
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


def train(msg: Message, context: Context) -> Message:
    cfg = load_config(context.run_config)
    torch.set_num_threads(cfg["torch-threads"])
    pid, parts = _partition(context)
    conf = msg.content.config_records.get("config", {})
    rnd = int(conf.get("server-round", 0))
    if ADAMW_STATE_KEY not in context.state and RESUME_DIR_KEY in conf:
        restore_node_state(
            context.state, Path(str(conf[RESUME_DIR_KEY])), pid, int(conf[RESUME_ROUND_KEY])
        )
    handler = make_diloco_train_handler(
        lambda ctx: build_model(cfg),
        lambda ctx: node_batches(cfg, pid, parts),
        seed=cfg.seed,
    )
    reply = handler(msg, context)
    if STATE_DIR_KEY in conf:
        save_node_state(context.state, Path(str(conf[STATE_DIR_KEY])), pid, rnd)
    return reply


app.train()(train)
