"""DiLoCo's compressed downloads (``download=``): the glue between the strategy and
:class:`~flwr_isoloco.compression.broadcast.Broadcast` (the protocol is documented there).

With a download codec the workers train from the broadcast model ``B``, so their deltas are
taken against ``B`` (:func:`train_base`) and the outer step moves the server's ``theta``:
``theta <- theta - lr * outer(mean_i(B - theta_i))``. ``B = theta - e`` lags ``theta`` by the
residual ``e`` that error feedback sends later; the run's result is the server's ``theta`` (it
holds every accepted update; ``B`` is ``theta`` less what is still queued), while federated
evaluation measures ``B``, the model the nodes hold: after round r's outer step ``B`` advances
once (:func:`follow_theta`), so round r's evaluation and round r + 1's training get the same
``B + decode(Q(theta_r - B))``, ``theta_r`` less the residual.

Per train reply (:class:`TrainReplies`): a node that refuses an update because it lost its copy
gets the full ``B`` within the round, and :class:`CodecUse` says when the ClientApp does not run
the mods a codec needs.
"""

from __future__ import annotations

from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log

from flwr_isoloco.compression import is_compressed, payload_nbytes
from flwr_isoloco.compression.broadcast import Broadcast, asks_for_full, reply_digest
from flwr_isoloco.compression.step import EXACT, build_step
from flwr_isoloco.merging.options import check_options, rule_applies
from flwr_isoloco.strategies.diloco.settings import Codec

RESTORED = "restored"
"""``Broadcast.version``'s object part after a resume whose checkpoint held the ``B`` of the
theta it saved (the restored theta is a new object)."""


def setup_downloads(s: Any, arrayrecord_key: str) -> None:
    """``s.broadcast`` (None without a download codec), ``s.codec_use``, and the refusals of an
    exact download (:func:`exact_problems`)."""
    s.broadcast = None if s.download is None else new_broadcast(s.download)
    s.eval_bytes_down = 0  # the evaluation messages' arrays (evaluated)
    s.codec_use = CodecUse(s.upload, s.download, arrayrecord_key)
    if problems := exact_problems(s):
        raise ValueError("download='exact': " + "; ".join(problems))


SPARSE_UPLOADS = ("sparseloco", "topk")
"""Upload codecs whose messages are small enough to send M of them down (``download="exact"``)."""


def exact_problems(s: Any) -> list[str]:
    """Why ``s``'s step cannot be sent exactly as the round's uploads (empty: it can): the
    step must be a function of this round's compressed uploads alone."""
    if s.download is None or s.download.name != EXACT:
        return []
    out = []
    if s.upload is None:
        out.append(
            "it sends the round's upload messages, which without an upload codec are the full "
            "deltas, M times the model: set upload=Codec('sparseloco')"
        )
    elif s.upload.name not in SPARSE_UPLOADS:
        out.append(
            f"upload={s.upload.name!r} is dense: the step record would hold M such uploads, more "
            f"than the model from a few nodes on; use a sparse upload codec {SPARSE_UPLOADS}"
        )
    if s.outer.momentum != 0:
        out.append(
            f"outer_momentum={s.outer.momentum} adds past rounds' steps, which the nodes do not "
            "have: use outer_momentum=0 (SparseLoCo: the workers' error feedback takes its "
            "place) or a re-compressed download such as Codec('int4')"
        )
    if s.merger.name not in ("mean", "sparseloco") or s.merger.orthogonalize == "update":
        out.append(
            f"merge={s.merger.name!r} makes the step dense, not a sum of the sparse uploads: use "
            "merge='mean' or 'sparseloco', or a re-compressed download such as Codec('int4')"
        )
    if s.merger.robust is not None:
        out.append("a robust rule is not a weighted sum of the uploads: use robust=None")
    if s.dp.settings is not None and s.dp.mode == "central":
        out.append("central DP noises the step densely: use LocalDP or download=None")
    return out


def exact_record(s: Any, used: list[Any], weights: list[float], uploads: dict, buffers) -> None:
    """Under an exact download, ``s.broadcast.step`` = the step record of the round's ``used``
    replies (:func:`~flwr_isoloco.compression.step.build_step`; ``uploads``: id(reply) -> its
    compressed record) for the outer step to take (:func:`outer_or_exact`); None when a used
    reply was not compressed or the model has buffers (BatchNorm statistics are not a sum of
    the uploads): that round's nodes then get the full model, said once."""
    b = s.broadcast
    if b is None or not b.exact or not used:
        return
    recs = [uploads.get(id(r)) for r in used]
    why = "the model has buffers (BatchNorm statistics)" if buffers else None
    if why is None and any(rec is None or not is_compressed(rec) for rec in recs):
        why = "a used reply was not compressed (its ClientApp does not run upload_mod)"
    if why is not None:
        b.step = None
        if "exact" not in s.codec_use.warned:
            s.codec_use.warned.add("exact")
            log(WARNING, "download='exact': %s; nodes get the full model this round", why)
        return
    total = sum(weights)
    rule = s.merger.name
    shapes = {k: tuple(v.shape) for k, v in s.theta.items()}
    _, pattern = check_options(s.merger.rule, s.merger.options)  # the tensors the rule acts on
    per_entry = [
        k for k, v in s.theta.items() if rule == "sparseloco" and rule_applies(k, v, pattern)
    ]
    b.step = build_step(recs, [w / total for w in weights], per_entry, -s.outer.lr, shapes)


def outer_or_exact(s: Any, params: dict, g: Any, transform: Any) -> dict:
    """The outer step of ``params``: the round's exact step when there is one
    (``Broadcast.stepped``: the nodes' arithmetic), else ``s.outer.step`` on ``g``."""
    b = s.broadcast
    if b is not None and b.step is not None:
        return b.stepped(params)
    return s.outer.step(params, {k: g[k] for k in params}, update_transform=transform)


def new_broadcast(codec: Codec) -> Broadcast:
    """The server's broadcast state for ``codec`` (its ``error_feedback`` must be on: what is
    not sent has to go out later, else B drifts from theta for good)."""
    if not codec.error_feedback:
        raise ValueError("download codec needs error_feedback=True (the server's residual)")
    return Broadcast(codec.name, codec.options, nodes_hold_initial=codec.nodes_hold_initial)


def train_base(b: Broadcast | None, theta: Any) -> Any:
    """The model the workers trained from, which their deltas are taken against: ``B`` with a
    download codec (in fp32, as ``theta``: a no-copy view for an fp32 model), else ``theta``."""
    if b is None or b.base is None:
        return theta
    return {k: v.float() for k, v in b.base.items()}


def follow_theta(b: Broadcast | None, theta: Any, dtypes: Any, server_round: int) -> None:
    """``B`` takes one step towards ``theta`` (``Broadcast.advance``) per version of ``theta``.

    Round r's evaluation (after its outer step) and round r + 1's training see the same version,
    ``(rounds aggregated, the theta object)``: the first advances ``B``, the other sends the same
    ``B``, so the nodes evaluate the model they then train from. ``theta`` is replaced, never
    changed in place, so its object names its version within a round (a round the divergence
    guard skips puts back another object: ``B`` follows it). A new round advances ``B`` again
    even when no reply moved ``theta`` (the gap ``theta - B`` keeps closing)."""
    if b is None:  # no download codec
        return
    key = (server_round, id(theta))
    if b.base is None or b.version not in (key, (server_round, RESTORED)):
        b.advance(theta, dtypes)
    b.version = key


def _message(s: Any, node: int, arrays: Any, config: Any, entries: dict, mtype: str) -> Message:
    cfg = ConfigRecord({**dict(config), **entries})
    content = RecordDict({s.arrayrecord_key: arrays, s.configrecord_key: cfg})
    return Message(content=content, message_type=mtype, dst_node_id=node)


def broadcast_messages(
    s: Any, config: ConfigRecord, nodes: list[int], mtype: str
) -> tuple[list[Message], int]:
    """One message per node (the update, nothing, or the full ``B``: Broadcast.for_node) and
    the bytes of the arrays they carry."""
    msgs, total = [], 0
    for n in nodes:
        arrays, entries = s.broadcast.for_node(n)
        total += payload_nbytes(arrays)
        msgs.append(_message(s, n, arrays, config, entries, mtype))
    return msgs, total


def evaluated(s: Any, ledger: Any, replies: list[Message], agg: Any) -> Any:
    """An evaluation round's metrics ``agg`` (None: none) under a download codec: the digest
    each reply's node says it holds is recorded (none or an error: the full ``B`` next time),
    and ``bytes-down`` (``s.eval_bytes_down``) is added, the evaluation messages' arrays (the
    update of ``B``, which the next round's training then need not send)."""
    if s.broadcast is None:
        return agg
    for msg in replies:
        s.broadcast.note(ledger.sender(msg), msg)
    return None if agg is None else MetricRecord({**agg, "bytes-down": s.eval_bytes_down})


UNUSED = {
    "download": (
        "download={codec!r}: {n} of {m} train replies of round {r} (nodes {nodes}) carry no "
        "download digest: their ClientApp does not run download_mod, so they get the full model "
        "in fp32 every round (no bytes saved) and train from B, which lags the server's model by "
        "the codec's residual. Add it: ClientApp(train=..., mods=[download_mod, upload_mod]) "
        "with `from flwr_isoloco.clients import download_mod, upload_mod`; or set download=None"
    ),
    "upload": (
        "upload={codec!r}: {n} of {m} train replies of round {r} (nodes {nodes}) are not "
        "compressed: their ClientApp does not run upload_mod (the DiLoCo worker compresses by "
        "itself), so they go up in fp32. Add it: ClientApp(train=..., mods=[download_mod, "
        "upload_mod]) with `from flwr_isoloco.clients import download_mod, upload_mod`; or set "
        "upload=None"
    ),
}


class CodecUse:
    """Whether the ClientApp honours the codecs: under a download codec a train reply carries
    its node's digest (``download_mod``), under an upload codec compressed arrays
    (``upload_mod``, or the DiLoCo worker). A round with a reply that does not is said in a
    WARNING (:data:`UNUSED`), once per run and direction. The run goes on: it is correct (the
    nodes train from ``B``, their deltas are taken against it), it only pays for a codec it
    does not get, and the other nodes of a mixed federation may well run the mods."""

    def __init__(self, upload: Codec | None, download: Codec | None, arrayrecord_key: str):
        self.codecs = {"download": download, "upload": upload}
        self.key = arrayrecord_key
        self.warned: set[str] = set()
        self._lacking: dict[str, list[int]] = {"download": [], "upload": []}
        self._replies = 0

    def see(self, node: int, msg: Message) -> None:
        """Count ``msg`` (an error reply says nothing about the ClientApp's mods)."""
        if msg.has_error():
            return
        self._replies += 1
        if self.codecs["download"] is not None and reply_digest(msg) is None:
            self._lacking["download"].append(node)
        arrays = msg.content.array_records.get(self.key)
        if self.codecs["upload"] is not None and arrays is not None and not is_compressed(arrays):
            self._lacking["upload"].append(node)

    def close(self, server_round: int) -> None:
        """Warn about round ``server_round``'s replies (class docstring), then forget them."""
        for direction, nodes in self._lacking.items():
            if nodes and direction not in self.warned:
                self.warned.add(direction)
                shown = ", ".join(str(n) for n in nodes[:5]) + (", ..." if len(nodes) > 5 else "")
                text = UNUSED[direction].format(
                    codec=self.codecs[direction].name,
                    n=len(nodes),
                    m=self._replies,
                    r=server_round,
                    nodes=shown,
                )
                log(WARNING, "%s", text)
        self._lacking, self._replies = {"download": [], "upload": []}, 0


class TrainReplies:
    """A train round's replies on their way to ``take`` (``TrainRound.take``).

    Each is counted by ``s.codec_use`` (:class:`CodecUse`). Under a download codec, when
    ``config`` (the round's train config) is given, a node's refusal of an update that asks
    for the full model (``asks_for_full``: it lost its copy, e.g. it restarted) is answered
    within the round: the full ``B`` is returned for ReplyStream to push in the refusal's place
    (once per node and round; ``ledger`` then expects that message's reply), and ``resent``
    counts its bytes. Without ``config`` (Flower's one-list rounds) the refusal is dropped and
    named, and the node gets the full ``B`` next round."""

    def __init__(self, s: Any, ledger: Any, take: Any, config: ConfigRecord | None = None):
        self.s, self.ledger, self.take, self.config = s, ledger, take, config
        self.resent = 0
        self._done: set[int] = set()

    def close(self, server_round: int) -> int:
        """End of the round: ``s.codec_use`` says what it saw; returns ``resent``."""
        self.s.codec_use.close(server_round)
        return self.resent

    def __call__(self, msg: Message) -> Message | None:
        s, node = self.s, self.ledger.sender(msg)
        b = s.broadcast
        if b is None or self.config is None or node in self._done or not asks_for_full(msg):
            s.codec_use.see(node, msg)
            self.take(msg)
            return None
        self._done.add(node)
        b.note(node, msg)  # it holds no copy we know of: for_node gives the full B
        arrays, entries = b.for_node(node)
        follow = _message(s, node, arrays, self.config, entries, MessageType.TRAIN)
        self.ledger.replace(msg.metadata.reply_to_message_id, follow)
        self.resent += payload_nbytes(arrays)
        log(INFO, "node %d: %s; sending it the full model in this round", node, msg.error.reason)
        return follow


def broadcast_state(s: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, meta)`` of the checkpoint: ``B``; its digest, codec and whether it is the
    ``B`` of the saved theta (advanced after the last step: :func:`follow_theta`); the residual
    is ``theta - B``, restored with theta."""
    b = s.broadcast
    sd = b.state_dict()
    current = b.version == (s.server_round, id(s.theta))
    return {"base": sd["base"]}, {"digest": sd["digest"], "codec": b.codec, "current": current}


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
    if not isinstance(info.get("current", False), bool):
        raise ValueError(f"'broadcast.current' must be a bool, got {info.get('current')!r}")
    b = new_broadcast(s.download)
    b.load_state_dict({"base": base, "digest": info.get("digest")})  # a residual saved by an
    # older version (sent on top of theta - B, which double-counted) is checked, then dropped
    if info.get("current") is True:  # the B of the saved theta: not advanced again
        b.version = (state["meta"].get("server_round"), RESTORED)
    return b
