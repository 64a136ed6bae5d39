"""ClientApp: the peft LoRA client of :mod:`flwr_isoloco.clients.lora_client`.

Settings come from the same validated run config as the server (``task.load_config``); the
node's shard is ``partition-id`` of ``num-partitions`` from its ``node_config``, or, when the
node config has a non-empty ``data-path``, the site's own absolute ``.csv``/``.tsv`` file with
``text`` and ``label`` (0/1) columns (``partition-id`` still names the node's graph vertex).
``train.device`` is resolved on the node before anything is loaded: ``auto`` is the GPU this
node's process sees (in a simulation, one given by ``options.backend.client-resources.num-gpus``;
with the default 0 Ray hides every GPU from the node), ``cuda`` where none is visible is refused
naming the key and the fix.
"""

from __future__ import annotations

from flwr.app import Context
from flwr.clientapp import ClientApp

from flwr_isoloco.clients.lora_client import LoRAClient, LoRAClientConfig
from flwr_isoloco.merging.device import resolve_node_device

from .task import client_config, load_config


def node_config(context: Context) -> LoRAClientConfig:
    """The node's client settings from the run config, its ``train.device`` checked here."""
    cfg = load_config(dict(context.run_config))
    resolve_node_device(cfg.train.device, what="train.device")
    return client_config(cfg)


app = ClientApp()
client = LoRAClient(node_config)
client.register(app)
