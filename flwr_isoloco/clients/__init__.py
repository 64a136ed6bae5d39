"""Client building blocks: ClientApp handlers and their training loops.

- ``diloco_worker.py``: DiLoCo worker (H inner AdamW steps, optimiser state in ``context.state``).
- ``lora_client.py``: peft LoRA client that sends only the adapter.
- ``query.py``: :func:`partition_id_query`, an ``@app.query()`` handler for the graph
  strategies' vertex query.
"""

from importlib import import_module

from .query import partition_id_query  # plain import: light (no torch)

_EXPORTS = {
    "make_diloco_train_handler": "diloco_worker",
    "make_lm_evaluate_handler": "diloco_worker",
    "LoRAClient": "lora_client",
    "LoRAClientConfig": "lora_client",
}


__all__ = ["partition_id_query", *sorted(_EXPORTS)]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
