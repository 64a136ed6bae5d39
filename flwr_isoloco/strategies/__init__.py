"""Server-side Flower strategies (Message API).

- :class:`DiLoCo`, :class:`IsoLoCo` (``diloco.py``): merge pseudo-gradients + outer optimiser.
- :class:`RWLoRA` (``rwlora.py``): one adapter walks the client graph, one node per round.
- :class:`GossipLoRA` (``gossip.py``): decentralised-SGD baseline with Metropolis mixing.
"""

from importlib import import_module

_EXPORTS = {
    "DiLoCo": "diloco",
    "IsoLoCo": "diloco",
    "RWLoRA": "rwlora",
    "GossipLoRA": "gossip",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    # Lazy so that importing one strategy does not import the others (and Flower) needlessly.
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
