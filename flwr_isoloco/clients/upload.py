"""``upload_mod``: compressed uploads for an unchanged FedAvg-style train handler.

The server asks for a codec in the train config (``upload-codec`` and the ``codec-*`` keys,
:func:`~flwr_isoloco.compression.parse_request`): the message's ConfigRecord that carries
``upload-codec``, whatever the strategy named it (several such records: refused). The DiLoCo worker compresses inside its own
handler; a plain handler replies the full weights ``theta_i``. This mod turns such a reply into
the compressed delta ``theta - theta_i`` with the node's error feedback (the residual in
``context.state``), the same reply the worker would send (:func:`.worker_reply.reply_content`).

Order: ``ClientApp(mods=[download_mod, upload_mod])``: ``download_mod`` (outer) rebuilds the
broadcast model first, so the delta is taken against the model the handler trained from. A
reply that is already a delta (a ConfigRecord with ``payload == "delta"``), an error, or a
message that asks for no codec passes through untouched.
"""

from __future__ import annotations

from logging import WARNING

from flwr.app import Context, Error, Message
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.logger import log

from flwr_isoloco.compression import CODEC_KEY, parse_request

from .download import REFUSED_CODE, config_carrying
from .worker_reply import reply_content

__all__ = ["upload_mod"]


def _refuse(msg: Message, why: str) -> Message:
    log(WARNING, "upload_mod refused: %s", why)
    return Message(Error(REFUSED_CODE, f"upload_mod refused: {why}"), reply_to=msg)


def upload_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Compress a train reply's weights as the server asks (module docstring)."""
    cfg = config_carrying(msg, CODEC_KEY)
    if not msg.metadata.message_type.startswith("train") or cfg is None:
        return call_next(msg, context)
    if isinstance(cfg, str):
        return _refuse(msg, cfg)
    try:
        request = parse_request(cfg)
    except ValueError as exc:
        return _refuse(msg, str(exc))
    keys = list(msg.content.array_records)
    if request is None or len(keys) != 1:
        return call_next(msg, context)
    theta = msg.content.array_records[keys[0]].to_torch_state_dict()
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    if any(rec.get("payload") == "delta" for rec in reply.content.config_records.values()):
        return reply  # the handler compressed already (the DiLoCo worker)
    arrays = reply.content.array_records.get(keys[0])
    if arrays is None:
        return _refuse(msg, f"the handler's reply has no ArrayRecord {keys[0]!r}")
    new = arrays.to_torch_state_dict()
    if set(new) != set(theta) or any(new[k].shape != theta[k].shape for k in new):
        return _refuse(msg, "the handler's reply does not have the received model's tensors")
    content = reply_content(theta, new, request, "weights", context.state, keys[0])
    for name in content:
        reply.content[name] = content[name]
    return reply
