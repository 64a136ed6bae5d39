"""ClientApp: the peft LoRA client of :mod:`flwr_isoloco.clients.lora_client`.

Settings come from the same validated run config as the server (``task.load_config``); the
node's shard is ``partition-id`` of ``num-partitions`` from its ``node_config``.
"""

from __future__ import annotations

from flwr.clientapp import ClientApp

from flwr_isoloco.clients.lora_client import LoRAClient

from .task import client_config, load_config

app = ClientApp()
client = LoRAClient(lambda context: client_config(load_config(dict(context.run_config))))
client.register(app)
