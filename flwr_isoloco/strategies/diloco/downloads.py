"""DiLoCo's compressed downloads (``download=``): the glue between the strategy and
:class:`~flwr_isoloco.compression.broadcast.Broadcast` (the protocol is documented there).

With a download codec the workers train from the broadcast model ``B``, so their deltas are
taken against ``B`` (``DiLoCo.train_base``) and the outer step moves the server's ``theta``:
``theta <- theta - lr * outer(mean_i(B - theta_i))``. ``B = theta - e`` lags ``theta`` by the
residual ``e`` that error feedback sends later; the run's result is the server's ``theta`` (it
holds every accepted update; ``B`` is ``theta`` less what is still queued), while federated
evaluation measures ``B``, the model the nodes hold.
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ConfigRecord, Message, RecordDict

from flwr_isoloco.compression import payload_nbytes
from flwr_isoloco.compression.broadcast import Broadcast
from flwr_isoloco.strategies.diloco.settings import Codec


def new_broadcast(codec: Codec) -> Broadcast:
    """The server's broadcast state for ``codec`` (its ``error_feedback`` must be on: what is
    not sent has to go out later, else B drifts from theta for good)."""
    if not codec.error_feedback:
        raise ValueError("download codec needs error_feedback=True (the server's residual)")
    return Broadcast(codec.name, codec.options, nodes_hold_initial=codec.nodes_hold_initial)


def broadcast_messages(s: Any, config: ConfigRecord, nodes: list[int], mtype: str) -> list[Message]:
    """One message per node (the update, nothing, or the full ``B``: Broadcast.for_node);
    sets ``s.book.bytes_down`` to the bytes of the arrays sent."""
    msgs, total = [], 0
    for n in nodes:
        arrays, entries = s.broadcast.for_node(n)
        cfg = ConfigRecord({**dict(config), **entries})
        total += payload_nbytes(arrays)
        content = RecordDict({s.arrayrecord_key: arrays, s.configrecord_key: cfg})
        msgs.append(Message(content=content, message_type=mtype, dst_node_id=n))
    s.book.bytes_down = total
    return msgs


def note_download(s: Any, msg: Message, ledger: Any = None) -> Message:
    """Record the digest the reply's node says it holds (none or an error: it gets the full
    ``B`` next time); returns ``msg``."""
    if s.broadcast is not None:
        node = (ledger or s.book.eval_ledger).sender(msg)
        s.broadcast.note(node, msg)
    return msg


def broadcast_state(b: Broadcast) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, meta)`` of the checkpoint: ``B``; its digest and codec (the residual is
    ``theta - B``, restored with theta)."""
    sd = b.state_dict()
    return {"base": sd["base"]}, {"digest": sd["digest"], "codec": b.codec}


def parse_broadcast(s: Any, state: Any) -> Broadcast | None:
    """A :class:`Broadcast` from checkpoint ``state`` (hostile input: ``B`` and the residual
    must name theta's tensors with theta's shapes, be floating and finite, ``B`` must match its
    saved digest, the codec must be ours); None without a download codec or a saved ``B``."""
    if s.download is None:
        return None
    tensors, meta = state["tensors"], state["meta"]
    saved, info = tensors.get("broadcast"), meta.get("broadcast")
    if saved is None and info is None:
        return None
    if not isinstance(saved, dict) or not isinstance(info, dict):
        raise ValueError("'broadcast' tensors and meta must both be dicts")
    if info.get("codec") != s.download.name:
        raise ValueError(
            f"saved with codec {info.get('codec')!r}, this run uses {s.download.name!r}"
        )
    theta = tensors.get("theta")
    base, residual = saved.get("base"), saved.get("residual", {})
    if not isinstance(theta, dict) or not isinstance(base, dict) or not isinstance(residual, dict):
        raise ValueError("'base' / 'residual' must be dicts of tensors")
    for name, part in (("base", base), ("residual", residual)):
        for k, v in part.items():
            t = theta.get(k)
            if not isinstance(v, torch.Tensor) or t is None or tuple(v.shape) != tuple(t.shape):
                raise ValueError(f"{name} tensor {k!r} is not one of theta's, with its shape")
    if set(base) != set(theta):
        raise ValueError("'base' does not name theta's tensors")
    b = new_broadcast(s.download)
    b.load_state_dict({"base": base, "digest": info.get("digest")})  # a residual saved by an
    # older version (sent on top of theta - B, which double-counted) is checked, then dropped
    return b
