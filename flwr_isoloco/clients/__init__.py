"""Client building blocks: ClientApp handlers and their training loops.

- ``diloco_worker.py``: DiLoCo worker (H inner AdamW steps, optimiser state in ``context.state``),
  set with ``train=TrainSettings(...)`` and ``runtime=Runtime(...)`` (``worker_settings.py``);
  ``inner_loop.py`` its inner steps (and :class:`Pace`, a study's emulated speed),
  ``worker_cache.py`` its per-process cache (model and moments on the device between
  messages), ``precision.py`` autocast / fp16 scaler (:data:`PRECISIONS`,
  :func:`check_precision`), shared with the LoRA clients;
  :func:`cache_stats` / :func:`clear_caches` report on and free the worker's cache.
- ``distributed.py``: :func:`make_distributed_train_handler`, the same worker on several devices
  of one site (a ``torch.distributed`` DDP group per message).
- ``lora_client.py``: peft LoRA client that sends only the adapter.
- ``adamw_state.py``: the AdamW state codec both use (named fp32 tensors, no pickle).
- ``node_state.py``: :func:`~.node_state.with_node_state`, node-state files for exact resume;
  between rounds the large records wait there, a handle in ``context.state``.
- ``hf_lm.py``: helpers to run the DiLoCo worker on any Hugging Face causal LM and a
  ``datasets.Dataset`` of text (model function, tokenization, flwr-datasets partitions).
- ``download.py``: :func:`download_mod`, the node side of compressed downloads (rebuilds the
  broadcast model from the stored copy + the update before an unchanged handler runs);
  :func:`make_download_mod` for nodes that build the initial model themselves.
- ``upload.py``: :func:`upload_mod`, compressed uploads (with error feedback) for an unchanged
  handler that replies full weights; ``mods=[download_mod, upload_mod]`` for both ways.
- ``secagg.py``: :func:`secagg_mod`, the node side of SecAgg+ for the DiLoCo strategies
  (Flower's ``secaggplus_mod`` around the train handler), and the config keys it shares with
  the server.
- ``query.py``: :func:`partition_id_query`, an ``@app.query()`` handler for the graph
  strategies' vertex query.
"""

from .diloco_worker import make_diloco_train_handler, make_lm_evaluate_handler
from .distributed import make_distributed_train_handler
from .download import download_mod, make_download_mod
from .inner_loop import Pace
from .lora_client import LoRAClient, LoRAClientConfig
from .precision import PRECISIONS, check_precision
from .query import partition_id_query
from .secagg import secagg_mod
from .upload import upload_mod
from .worker_cache import cache_stats, clear_caches
from .worker_settings import Runtime, TrainSettings

__all__ = [
    "PRECISIONS",
    "LoRAClient",
    "LoRAClientConfig",
    "Pace",
    "Runtime",
    "TrainSettings",
    "cache_stats",
    "check_precision",
    "clear_caches",
    "download_mod",
    "make_diloco_train_handler",
    "make_distributed_train_handler",
    "make_download_mod",
    "make_lm_evaluate_handler",
    "partition_id_query",
    "secagg_mod",
    "upload_mod",
]
