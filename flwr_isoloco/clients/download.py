"""``download_mod``: the node side of compressed downloads (flwr_isoloco/compression/broadcast.py).

``ClientApp(train=..., evaluate=..., mods=[download_mod])`` with an unchanged handler: the mod
rebuilds the full arrays ``B`` from the node's stored copy and the received update before the
handler runs, stores ``B`` (and its digest) in ``context.state``, and adds the digest to the
reply. The config is the message's ConfigRecord that carries ``download-digest``, whatever the
strategy named it (``configrecord_key``); a message where none does passes through untouched,
one where several do is refused (the mod cannot tell which one the server wrote).

Refusals (an error reply, the handler never runs): an update whose base digest is not the
stored copy's (none after a restart), a stored copy that no longer matches its digest, an
undecodable update, a result whose digest is not the announced one. A refusal of an update
says which copy the node holds and asks for the full model (``NEEDS_FULL_CODE``, reason
``NEEDS_FULL ...``): the strategy sends it within the same round.

``make_download_mod(initial=fn)``: for a strategy whose download codec has
``nodes_hold_initial=True`` (round 1 sends no arrays), ``fn(context)`` builds the initial model
(name -> tensor, the server's names and dtypes) when the node holds no copy yet; a build whose
digest is not the announced base is refused like any other mismatch (the server then sends the
full model next time).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from logging import WARNING

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.logger import log

from flwr_isoloco.compression.broadcast import (
    BASE_KEY,
    DIGEST_KEY,
    HELD_KEY,
    NEEDS_FULL,
    NEEDS_FULL_CODE,
    REPLY_RECORD,
    apply_download,
    model_digest,
)

STATE_ARRAYS = "download-base-model"
STATE_CONFIG = "download-base-digest"
REFUSED_CODE = 2  # CLIENT_APP_RAISED_EXCEPTION: the server drops the reply and names the node

__all__ = [
    "REFUSED_CODE",
    "STATE_ARRAYS",
    "STATE_CONFIG",
    "config_carrying",
    "download_mod",
    "make_download_mod",
    "stored_digest",
]

Initial = Callable[[Context], Mapping[str, torch.Tensor]]


def stored_digest(context: Context) -> str:
    """The digest of the copy ``context.state`` holds (``""``: none)."""
    rec = context.state.config_records.get(STATE_CONFIG)
    held = None if rec is None else rec.get(HELD_KEY)
    return held if isinstance(held, str) else ""


def _refuse(msg: Message, why: str) -> Message:
    log(WARNING, "download_mod refused: %s", why)
    return Message(Error(REFUSED_CODE, f"download_mod refused: {why}"), reply_to=msg)


def _ask_full(msg: Message, context: Context, why: str) -> Message:
    """Refuse an update and ask for the full model (broadcast.py: ``asks_for_full``)."""
    held = stored_digest(context)[:12] or "none"
    reason = f"{NEEDS_FULL} (refused: {why}; this node holds {held})"
    log(WARNING, "%s", reason)
    return Message(Error(NEEDS_FULL_CODE, reason), reply_to=msg)


def config_carrying(msg: Message, key: str) -> ConfigRecord | str | None:
    """The ConfigRecord of ``msg`` that holds ``key``, whatever its name (a strategy's
    ``configrecord_key`` need not be ``"config"``); None when none holds it, the reason (str)
    when several do: which one the server meant cannot be told, so the mod refuses."""
    found = [name for name, rec in msg.content.config_records.items() if key in rec]
    if len(found) > 1:
        return f"ConfigRecords {found} all carry {key!r}: ambiguous, which is the server's?"
    return msg.content.config_records[found[0]] if found else None


def _held(context: Context, base: str, initial: Initial | None):
    """The node's copy that ``base`` names (stored, or built by ``initial`` when the node holds
    none), or a refusal reason (str)."""
    stored = STATE_ARRAYS in context.state.array_records and stored_digest(context) != ""
    if not stored and initial is not None:
        built = {k: torch.as_tensor(v) for k, v in initial(context).items()}
        got = model_digest(built)
        if got != base:
            return f"this node's own initial model is {got[:12]}, the server's {base[:12]}"
        return built
    if stored_digest(context) != base or not stored:
        return f"an update for base {base[:12]}, not the copy this node holds"
    held = context.state.array_records[STATE_ARRAYS].to_torch_state_dict()
    if model_digest(held) != base:  # the stored copy itself was changed or corrupted
        return "the stored copy does not match its digest"
    return held


def _rebuild(
    msg: Message, context: Context, key: str, base: str, digest: str, initial: Initial | None
):
    """The full ``B`` (name -> tensor) or a refusal reason (str)."""
    arrays = msg.content.array_records[key]
    if base == "":
        return arrays.to_torch_state_dict()
    held = _held(context, base, initial)
    if isinstance(held, str):
        return held
    if base == digest and len(arrays) == 0:
        return held
    try:
        return apply_download(held, arrays)
    except ValueError as exc:
        return f"update does not decode: {exc}"


def _reload_offloaded(context: Context) -> None:
    """Read back the ArrayRecords :func:`~flwr_isoloco.clients.node_state.with_node_state` put
    in its file (the stored ``B`` among them) before this mod reads or replaces ``B``: the
    wrapper, seeing no handle, then saves and offloads them again after the round; otherwise
    its reload would put the file's older ``B`` back over the new one."""
    from flwr_isoloco.clients.node_state import HANDLE_KEY, _reload

    pid = context.node_config.get("partition-id")
    if HANDLE_KEY in context.state and pid is not None:
        _reload(context, int(pid))


def make_download_mod(initial: Initial | None = None):
    """``download_mod`` whose node builds the initial model with ``initial`` (module docstring)."""

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        return _download(msg, context, call_next, initial)

    return mod


def download_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Rebuild ``B`` (module docstring), run the handler on it, report ``B``'s digest."""
    return _download(msg, context, call_next, None)


def _download(msg: Message, context: Context, call_next: ClientAppCallable, initial) -> Message:
    cfg = config_carrying(msg, DIGEST_KEY)
    if cfg is None:
        return call_next(msg, context)
    if isinstance(cfg, str):
        return _refuse(msg, cfg)
    digest, base = cfg.get(DIGEST_KEY), cfg.get(BASE_KEY, "")
    keys = list(msg.content.array_records)
    if not isinstance(digest, str) or not isinstance(base, str) or len(keys) != 1:
        return _refuse(msg, "malformed download entries")
    _reload_offloaded(context)
    full = _rebuild(msg, context, keys[0], base, digest, initial)
    if not isinstance(full, str) and model_digest(full) != digest:
        full = "the rebuilt model's digest is not the announced one"
    if isinstance(full, str):  # an update the full model replaces; a full model: refused
        return _refuse(msg, full) if base == "" else _ask_full(msg, context, full)
    record = ArrayRecord(full)
    context.state[STATE_ARRAYS] = record
    context.state[STATE_CONFIG] = ConfigRecord({HELD_KEY: digest})
    msg.content[keys[0]] = ArrayRecord(full)
    reply = call_next(msg, context)
    if not reply.has_error():
        reply.content[REPLY_RECORD] = ConfigRecord({HELD_KEY: digest})
    return reply
