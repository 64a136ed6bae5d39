"""Where the DiLoCo worker's model and AdamW moments come from: this process's cache or the
node's stored state.

A Flower node's state between messages is ``context.state`` (or, with
:func:`~flwr_isoloco.clients.node_state.with_node_state`, its node-state file): the AdamW
moments travel through it as an ArrayRecord (``diloco.adamw``) on every message, and the model
is rebuilt by ``model_fn``. In one process (a Ray actor serving several messages) two caches
skip that work; the stored state is still written on every message, so deployment (a fresh
process per message), node-state files and resume see exactly what they saw without them.

Model pool (:func:`borrow_model`): the model on the device (and its ``torch.compile`` wrapper,
compiled once) per key ``(run, model_fn's code, the received names/shapes/dtypes, device,
gradient checkpointing, compile)``, at most :data:`MODEL_SLOTS` of them. Every message loads the
received arrays into it (strict: every kept tensor), so what it held before is overwritten;
the key assumes that in one run ``model_fn`` builds the same architecture for every node (its
hyper-parameters come from the run config), which is what a DiLoCo run requires anyway.

Node moments (:func:`take_moments` / :func:`keep_moments`): per ``(run_id, node_id)`` the AdamW
state tensors the node's last message left on the device, with the token that message wrote
into the stored AdamW record (:data:`TOKEN_KEY`: 8 random bytes drawn once per process + a
counter). They are used only when the record the node's state holds now carries that token,
i.e. it is the record this process wrote last for the node; a record that is missing,
replaced (restored from a file, another process's, an older round's) or carries no token makes
the worker read the stored moments as without a cache. A message that fails drops the node's
entry (its tensors may be half updated). LRU with ``bound`` entries (the handler's
``cache_nodes``); each holds two fp32 copies of the trainable parameters on the device.

Where the moments are stored: an ArrayRecord in ``context.state`` (each message serialises
them, 2 x 4 bytes per trainable value), or, when the node has a private folder and no state to
resume from (:data:`.moments_file.MOMENTS_DIR_KEY`), a file there written by a background
thread while the message replies (:mod:`.moments_file`), with ``context.state`` holding the
file's handle.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.common.logger import log

from . import moments_file
from .adamw_state import (
    MOMENTS,
    adamw_to_arrays,
    adamw_to_flat,
    arrays_to_adamw,
    flat_to_adamw,
    flat_zeros,
)
from .record_io import pack_record, unpack_record

__all__ = [
    "ADAMW_STATE_KEY",
    "MODEL_SLOTS",
    "TOKEN_KEY",
    "NodeMoments",
    "borrow_model",
    "cache_stats",
    "clear_caches",
    "keep_moments",
    "load_adamw",
    "new_token",
    "restore_moments",
    "save_adamw",
    "store_moments",
    "stored_token",
    "take_moments",
]

ADAMW_STATE_KEY = "diloco.adamw"
TOKEN_KEY = "cache-token"
MODEL_SLOTS = 2

_NONCE = os.urandom(8)  # tells this process's tokens from any other's
_COUNTER = itertools.count(1)

Named = list[tuple[str, torch.nn.Parameter]]


@dataclass
class _Slot:
    model: torch.nn.Module
    forward: Any  # the model, or its torch.compile wrapper
    named: Named
    busy: bool = False


@dataclass
class NodeMoments:
    """One node's AdamW state left on the device: ``states[i]`` is ``opt.state`` of the
    ``i``-th trainable parameter (``names[i]``), None where it has none yet."""

    token: bytes
    names: tuple[str, ...]
    states: list[dict[str, torch.Tensor] | None]
    device: torch.device


@dataclass
class _Caches:
    models: OrderedDict = field(default_factory=OrderedDict)
    nodes: OrderedDict = field(default_factory=OrderedDict)
    stats: dict = field(default_factory=lambda: {"model-builds": 0, "hits": 0, "misses": 0})


_CACHES = _Caches()


def clear_caches() -> None:
    """Forget every pooled model and node entry (frees their device memory)."""
    _CACHES.models.clear()
    _CACHES.nodes.clear()
    moments_file.wait_writes()
    for k in _CACHES.stats:
        _CACHES.stats[k] = 0


def cache_stats() -> dict[str, int]:
    """Counters since the last :func:`clear_caches`: model builds in the pool, node hits and
    misses, and the entries held."""
    return {**_CACHES.stats, "models": len(_CACHES.models), "nodes": len(_CACHES.nodes)}


@contextlib.contextmanager
def borrow_model(
    key: tuple | None, build: Callable[[], tuple[torch.nn.Module, Any, Named]]
) -> Iterator[tuple[torch.nn.Module, Any, Named]]:
    """``(model, forward, named)`` from the pool under ``key`` (built with ``build`` on a miss);
    ``key=None``, or a slot already in use by this process (re-entrant or threaded calls), builds
    a model for this call only."""
    slot = _CACHES.models.get(key) if key is not None else None
    if key is not None and slot is None:
        slot = _Slot(*build())
        _CACHES.stats["model-builds"] += 1
        _CACHES.models[key] = slot
        while len(_CACHES.models) > MODEL_SLOTS:
            _CACHES.models.popitem(last=False)
    if slot is None or slot.busy:
        yield build()
        return
    _CACHES.models.move_to_end(key)
    slot.busy = True
    try:
        yield slot.model, slot.forward, slot.named
    finally:
        slot.busy = False


def new_token() -> torch.Tensor:
    """A token no other write of any process is expected to carry (16 bytes, uint8)."""
    tail = next(_COUNTER).to_bytes(8, "little")
    return torch.frombuffer(bytearray(_NONCE + tail), dtype=torch.uint8)


def stored_token(rec: object) -> bytes | None:
    """The token a stored AdamW record carries (None: none, or not a well-formed one); for a
    moments file's handle (a ConfigRecord), the token of the file it names."""
    if isinstance(rec, ConfigRecord):
        try:
            token = bytes.fromhex(str(rec.get("token", "")))
        except ValueError:
            return None
        return token if len(token) == 16 else None
    if not isinstance(rec, ArrayRecord) or TOKEN_KEY not in rec:
        return None
    try:
        arr = rec[TOKEN_KEY].numpy()
    except (TypeError, ValueError):
        return None
    return arr.tobytes() if arr.dtype.name == "uint8" and arr.shape == (16,) else None


def take_moments(
    node: tuple[int, int], token: bytes | None, named: Named, device: torch.device
) -> NodeMoments | None:
    """The node's cached moments if they are the ones behind ``token`` (the stored record's)
    and fit ``named`` on ``device``; the entry leaves the cache either way."""
    entry = _CACHES.nodes.pop(node, None)
    ok = (
        entry is not None
        and token is not None
        and entry.token == token
        and entry.device == device
        and entry.names == tuple(n for n, _ in named)
        and all(
            st is None or st["exp_avg"].shape == p.shape
            for st, (_, p) in zip(entry.states, named, strict=True)
        )
    )
    _CACHES.stats["hits" if ok else "misses"] += 1
    return entry if ok else None


def keep_moments(
    node: tuple[int, int],
    token: torch.Tensor,
    opt: torch.optim.Optimizer,
    named: Named,
    device: torch.device,
    bound: int,
) -> None:
    """Cache ``opt``'s state for ``named`` under ``node`` (most recent), at most ``bound``
    nodes (the least recently used leave)."""
    if bound < 1:
        return
    states = [opt.state.get(p) or None for _, p in named]
    names = tuple(n for n, _ in named)
    _CACHES.nodes[node] = NodeMoments(token.numpy().tobytes(), names, states, device)
    _CACHES.nodes.move_to_end(node)
    while len(_CACHES.nodes) > bound:
        _CACHES.nodes.popitem(last=False)


def load_adamw(opt: torch.optim.Optimizer, named: Named, state: RecordDict) -> bool:
    """Restore AdamW from ``state``: an ArrayRecord (:mod:`.adamw_state`, flat layout; the named
    layout is read too) or the handle of a moments file (:mod:`.moments_file`, checked before
    use); False (fresh optimiser) if absent or unusable (a warning says why)."""
    rec = state.get(ADAMW_STATE_KEY)
    if isinstance(rec, ConfigRecord):
        try:
            moments_file.attach(opt, named, rec)
        except ValueError as exc:  # MomentsFileError included
            log(WARNING, "DiLoCo worker: AdamW moments file refused (%s); fresh optimiser", exc)
            return False
        return True
    if not isinstance(rec, ArrayRecord):
        return False
    try:
        arrays = unpack_record(rec)
        if all(m in arrays for m in MOMENTS):
            flat_to_adamw(opt, named, arrays)
        else:
            arrays_to_adamw(opt, named, arrays, allow_extra=True)
    except ValueError as exc:
        log(WARNING, "DiLoCo worker: AdamW state unusable (%s); starting a fresh optimiser", exc)
        return False
    return True


def save_adamw(
    opt: torch.optim.Optimizer,
    named: Named,
    state: RecordDict,
    layout: str,
    token: torch.Tensor | None = None,
    path=None,
) -> None:
    """Write the AdamW state to ``state`` (fp32, on the CPU), with the cache's ``token``: as an
    ArrayRecord, or with ``path`` (and a ``token``) into the node's moments file there, whose
    handle ``state`` keeps (:func:`.moments_file.store`; the flat layout)."""
    if path is not None and token is not None:
        h = moments_file.store(opt, named, path, token.numpy().tobytes())
        state[ADAMW_STATE_KEY] = ConfigRecord(h)
        return
    if layout == "flat":
        arrays = adamw_to_flat(opt, named, share=True)  # packing copies them at once
    else:
        arrays = adamw_to_arrays(opt, named, step_arrays=True)[0]
    if token is not None:
        arrays[TOKEN_KEY] = token
    state[ADAMW_STATE_KEY] = pack_record(arrays)


def store_moments(
    opt: torch.optim.Optimizer,
    named: Named,
    context: Context,
    layout: str,
    device: torch.device,
    bound: int,
) -> None:
    """Save the AdamW state (:func:`save_adamw`: into the node's moments file when
    ``context.state`` names its folder, else into ``context.state``) and, with ``bound`` > 0,
    keep the moments in this process's cache under the token just written."""
    path = moments_file.moments_path(context.state, context.node_config, context.node_id)
    token = new_token() if bound > 0 or path is not None else None
    save_adamw(opt, named, context.state, layout, token, path)
    if bound > 0:
        keep_moments((context.run_id, context.node_id), token, opt, named, device, bound)


def restore_moments(
    opt: torch.optim.Optimizer, named: Named, context: Context, device: torch.device, bound: int
) -> None:
    """The node's moments from this process's cache when they are the stored ones (``bound``
    > 0 and the stored record carries the cached token), else from ``context.state``
    (:func:`load_adamw`). A background write of the moments (:mod:`.moments_file`) ends first."""
    moments_file.wait_writes()
    if bound > 0:
        token = stored_token(context.state.get(ADAMW_STATE_KEY))
        hit = take_moments((context.run_id, context.node_id), token, named, device)
        if hit is not None:
            for (_, p), st in zip(named, hit.states, strict=True):
                if st is not None:
                    opt.state[p] = st
            return
    if not load_adamw(opt, named, context.state):
        flat_zeros(opt, named)  # the first save then needs no second copy of the moments
