"""ClientApp: the peft LoRA client of :mod:`flwr_isoloco.clients.lora_client`.

Settings come from the same validated run config as the server (``task.load_config``); the
node's shard is ``partition-id`` of ``num-partitions`` from its ``node_config``, or, when the
node config has a non-empty ``data-path``, the site's own absolute ``.csv``/``.tsv`` file with
``text`` and ``label`` (0/1) columns (``partition-id`` still names the node's graph vertex).
"""

from __future__ import annotations

from flwr.clientapp import ClientApp

from flwr_isoloco.clients.lora_client import LoRAClient

from .task import client_config, load_config

app = ClientApp()
client = LoRAClient(lambda context: client_config(load_config(dict(context.run_config))))
client.register(app)
