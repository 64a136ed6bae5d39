"""ClientApp: a DiLoCo worker (H inner AdamW steps on the node's contiguous text shard, or on
its own text).

The training loop is :func:`flwr_isoloco.clients.make_diloco_train_handler`; this module only
supplies the model and the node's batches, and
:func:`~flwr_isoloco.clients.node_state.with_node_state` keeps the node-state files that make
``resume-from`` exact, and between rounds keeps the AdamW moments in them rather than in
``context.state`` (in a simulation that lives in the ServerApp's process; docs/strategies.md,
"The DiLoCo worker"; with ``checkpoint=false`` in a private per-run temp folder). The node's shard is ``partition-id`` of ``num-partitions`` from its
``node_config`` (set by the simulation engine, or ``--node-config`` in deployment). A node whose
``node_config`` has a non-empty ``data-path`` (absolute path to a .txt/.md file or a folder of
them) trains on all of that text instead, encoded with the run's tokenizer; if the path cannot
be used the node logs why and replies with an error (the server drops it, the run goes on).
With a pretrained model (``model.name-or-path``) the reply's metrics add ``worker-time-s``
(load, H inner steps, reply; the strategy averages it over the nodes, token-weighted) and
``worker-peak-rss-mb`` (the node process's peak RSS, averaged the same way).

``train.device`` is resolved first, before the node's data or model are touched: ``auto`` is
the GPU this node's process sees (in a simulation, one given by
``options.backend.client-resources.num-gpus``; with the default 0 Ray hides every GPU from the
node), else the CPU; ``cuda`` where none is visible is refused naming the key and the fix.
``train.precision``, ``train.compile`` and ``train.time-budget-s`` (speed-scaled local steps,
0 = off) go to the worker as they are (its ``Runtime`` and ``TrainSettings``).
``train.slowdown-spread`` / ``train.emulated-step-s`` emulate unequal sites on one machine
(:func:`node_slowdown`, the worker's ``pace=Pace(slowdown, step_s)``): the reply then adds the
task's wall-clock start and end (``task-start-s``, ``task-end-s``, for utilisation). The node
checks the strategy section for spelling only: ``strategy.merge-device`` is the server's
(task.load_config).
"""

from __future__ import annotations

import time
from logging import ERROR

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from flwr_isoloco.clients import Pace, Runtime, TrainSettings, make_diloco_train_handler, secagg_mod
from flwr_isoloco.clients.download import make_download_mod
from flwr_isoloco.clients.node_state import with_node_state
from flwr_isoloco.merging.device import resolve_node_device
from flwr_isoloco.models.hf import model_arrays

from .pretrained import is_pretrained, peak_rss_mb
from .task import (
    DATA_PATH_KEY,
    NodeDataError,
    build_model,
    load_config,
    local_batches,
    node_batches,
)


def _initial_model(context: Context) -> dict[str, torch.Tensor]:
    """The initial model as the server builds it (strategy.download-nodes-hold-initial)."""
    cfg = load_config(context.run_config, node=True)
    return model_arrays(build_model(cfg)).to_torch_state_dict()


# download mod: strategy.download-codec (rebuilds the broadcast model; no-op at "none"), and
# with strategy.download-nodes-hold-initial builds round 1's model here;
# secagg_mod: SecAgg+ train stages only; other messages pass through
app = ClientApp(mods=[make_download_mod(initial=_initial_model), secagg_mod])


def _partition(context: Context) -> tuple[int, int]:
    nc = context.node_config
    try:
        return int(nc["partition-id"]), int(nc["num-partitions"])
    except KeyError as exc:
        raise ValueError(
            f"node_config lacks {exc.args[0]!r} (set --node-config 'partition-id=.. num-partitions=..')"
        ) from None


def node_slowdown(cfg, context: Context) -> float:
    """This node's emulated slowdown: its ``node_config`` ``slowdown`` if set, else
    ``1 + (s - 1) p / (N - 1)`` for partition ``p`` of ``N`` at spread ``s`` (node 0 at 1x, the
    last at ``s`` x; a simulation's node_config holds only the partition)."""
    own = context.node_config.get("slowdown")
    if own is not None:
        if isinstance(own, bool) or not isinstance(own, (int, float)) or not own >= 1:
            raise ValueError(f"node_config slowdown must be a number >= 1, got {own!r}")
        return float(own)
    pid, parts = _partition(context)
    return 1.0 + (cfg.train["slowdown-spread"] - 1.0) * pid / max(parts - 1, 1)


def _train(msg: Message, context: Context) -> Message:
    cfg = load_config(context.run_config, node=True)
    device = resolve_node_device(cfg.train.device, what="train.device")  # before anything else
    torch.set_num_threads(cfg["torch-threads"])
    pid, parts = _partition(context)
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

    runtime = Runtime(
        device=device,
        precision=cfg.train.precision,
        compile=cfg.train.compile,
        micro_batch=cfg.train["micro-batch"],
        gradient_checkpointing=cfg.train["gradient-checkpointing"],
    )
    handler = make_diloco_train_handler(
        lambda ctx: build_model(cfg, init=False),  # every weight comes from the message
        data_fn,
        train=TrainSettings(time_budget_s=float(cfg.train["time-budget-s"])),
        runtime=runtime,
        seed=cfg.seed,
        pace=Pace(node_slowdown(cfg, context), float(cfg.train["emulated-step-s"])),
    )
    started, t0 = time.time(), time.perf_counter()
    reply = handler(msg, context)
    if reply.has_error():
        return reply
    if "emulated-slowdown" in reply.content["metrics"]:  # utilisation of an emulated site
        reply.content["metrics"]["task-start-s"] = started
        reply.content["metrics"]["task-end-s"] = time.time()
    if is_pretrained(cfg):  # where a pretrained model's round time and memory go
        reply.content["metrics"]["worker-time-s"] = time.perf_counter() - t0
        reply.content["metrics"]["worker-peak-rss-mb"] = peak_rss_mb()
    return reply


# The handler: resumable node state around the worker. With checkpoint=false (no folder from
# the server) the moments go to this machine's private per-run temp folder, which the
# ServerApp removes at the end of the run, rather than stay in context.state.
train = with_node_state(_train, temp_dir=True)
app.train()(train)
