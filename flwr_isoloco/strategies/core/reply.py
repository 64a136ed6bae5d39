"""One reply as the round sees it: the checked update (:class:`CheckedReply`) or the named
rejection (:class:`Rejection`), the round's counts (:class:`ReplyReport`), and what is read off
a raw reply before any check: its content digest (the merge order), its array bytes, its
numeric metrics and its ``inner-steps`` count. The checks themselves are
:class:`~flwr_isoloco.strategies.core.replies.ReplyValidator`'s.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from flwr.app import ArrayRecord, Message, RecordDict

from flwr_isoloco.compression import decompress, is_compressed, payload_nbytes
from flwr_isoloco.strategies.core.wire import record_tensors

__all__ = [
    "CheckedReply",
    "MAX_MERGEABLE_NORM",
    "PAYLOADS",
    "PAYLOAD_KEY",
    "Rejection",
    "ReplyReport",
    "array_digest",
    "content_digest",
    "is_number",
    "node_error_cause",
    "reply_metrics",
    "reply_nbytes",
    "steps_problem",
]

PAYLOAD_KEY = "payload"
"""ConfigRecord key a reply may set to say what its arrays hold: ``"weights"`` or ``"delta"``."""
PAYLOADS = ("weights", "delta")
MAX_MERGEABLE_NORM = 1e18
"""Largest update norm a reply may have: fp32 squares of larger entries overflow (1.8e19)."""


class Rejection(NamedTuple):
    """A dropped reply: the node it answers for and why (also a plain ``(node, reason)``)."""

    node_id: int
    reason: str


@dataclass
class CheckedReply:
    """A reply that passed validation.

    Arrays are decoded lazily by :meth:`tensors` (so a server folding replies one by one never
    holds M decoded copies); ``payload`` says whether they are the node's trained weights or
    its delta ``theta - theta_i``.
    """

    node_id: int
    weight: float
    metrics: dict[str, float]
    payload: str
    content: RecordDict
    arrayrecord_key: str = "arrays"
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    update_norm: float = 0.0  # ||u_i||_2 (fp64), set when the reference model was known
    digest: str = ""  # content_digest of the reply (set by ReplyValidator.check)
    _cache: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Drop the tensors decoded during validation (they are re-decoded on demand)."""
        self._cache = None

    def strip(self) -> None:
        """Drop the reply's arrays (its delta is folded or spilled); metrics and configs stay."""
        self._cache = None
        self.content = RecordDict(
            {**dict(self.content.metric_records), **dict(self.content.config_records)}
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The reply's arrays as torch tensors, cast to the expected dtypes."""
        if self._cache is not None:
            return dict(self._cache)
        rec = self.content.array_records.get(self.arrayrecord_key)
        if rec is None:
            return {}
        # validated once already: decode without the checks
        src = decompress(rec) if is_compressed(rec) else record_tensors(rec)
        return {
            k: t if (want := self.dtypes.get(k)) is None or t.dtype == want else t.to(want)
            for k, t in src.items()
        }

    def update(self, reference: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The pseudo-gradient ``delta_i = theta - theta_i`` (fp32), or the delta as sent."""
        arrays = self.tensors()
        if self.payload == "delta" or reference is None:
            return {k: v.float() for k, v in arrays.items()}
        return {k: reference[k].float() - v.float() for k, v in arrays.items()}


@dataclass
class ReplyReport:
    """What happened to one round's replies."""

    used: int = 0
    rejected: int = 0
    missing: int = 0  # sent but no reply was in when the round closed (late or timed out)
    lost: int = 0  # of ``rejected``: the node is gone (a NODE_UNAVAILABLE error reply)
    reasons: list[Rejection] = field(default_factory=list)
    bytes_up: int = 0  # array bytes of every reply received (payload_nbytes, dropped ones too)

    def as_metrics(self) -> dict[str, int]:
        """Counts for a MetricRecord."""
        return {
            "replies-used": self.used,
            "replies-rejected": self.rejected,
            "replies-missing": self.missing,
            "replies-lost": self.lost,
            "bytes-up": self.bytes_up,
        }


def array_digest(records: Mapping[str, ArrayRecord]) -> str:
    """sha256 over named ArrayRecords (record and array names, dtypes, shapes, bytes)."""
    h = hashlib.sha256()
    for rkey in sorted(records):
        for key, arr in records[rkey].items():
            h.update(f"{rkey}/{key}:{arr.dtype}:{tuple(arr.shape)}".encode())
            h.update(arr.data if isinstance(arr.data, bytes) else bytes(arr.data))
    return h.hexdigest()


def content_digest(msg: Message) -> str:
    """sha256 over a reply's array records (:func:`array_digest`); ``""`` without any.

    Replies are processed in this order: it depends only on what the replies hold, not on when
    they arrived nor on the node ids (which a simulation draws at random each run), so the
    floating-point summation order of a merge, and thus its last bits, repeat run after run.
    """
    if msg.has_error() or not msg.has_content():
        return ""
    return array_digest(msg.content.array_records)


def reply_nbytes(msg: Message) -> int:
    """Array bytes a reply carried (:func:`~flwr_isoloco.compression.payload_nbytes`), 0 if none."""
    if msg.has_error() or not msg.has_content():
        return 0
    return sum(payload_nbytes(r) for r in msg.content.array_records.values())


def reply_metrics(content: RecordDict) -> dict[str, float]:
    """Scalar numeric metrics of every MetricRecord in a reply (lists skipped)."""
    out: dict[str, float] = {}
    for rec in content.metric_records.values():
        for k, v in rec.items():
            if is_number(v) and math.isfinite(float(v)):
                out[k] = float(v)
    return out


def steps_problem(content: RecordDict, asked: int | None) -> str | None:
    """Why a reply's ``inner-steps`` metric (the inner steps a DiLoCo worker ran; fewer than
    asked under a time budget) cannot be trusted, or None: each occurrence must be an integral
    count ``>= 1`` and, when the server knows the ``local-steps`` it asked for, at most that
    (a node claiming more work than asked is hostile). Absent is fine."""
    for rec in content.metric_records.values():
        if "inner-steps" not in rec:
            continue
        n = rec["inner-steps"]
        if not is_number(n) or not math.isfinite(float(n)) or float(n) != int(n) or n < 1:
            return f"metric 'inner-steps' = {n!r} is not a count >= 1"
        if asked is not None and n > asked:
            return f"metric 'inner-steps' = {int(n)} is more than the {asked} local-steps asked"
    return None


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_WRAPPED = re.compile(r"^<class '([\w.()]+)'>:<'(.*)'>$", re.S)
_RAISED = "Exception ClientAppException occurred. Message: "
CAUSE_CHARS = 500


def node_error_cause(reason: str) -> str:
    """The ClientApp's own exception in an error reply's ``reason``, as ``Type: message``.

    Flower wraps it twice: the SuperNode as ``<class 'T'>:<'str(ex)'>``, a Ray simulation as
    ``RayTaskError(ClientAppException)`` whose text is Ray's actor repr, a traceback (ANSI
    coloured) and ``ClientAppException ... Message: str(ex)``, which drops the type; the type
    is read back from the traceback line that carries the message. Escapes and whitespace runs
    are removed, the result cut at ``CAUSE_CHARS``. A reason in neither form is kept as it is
    (escapes removed)."""
    text = _ANSI.sub("", str(reason))
    wrapped = _WRAPPED.match(text.strip())
    kind = wrapped.group(1).rsplit(".", 1)[-1] if wrapped else ""
    inner = wrapped.group(2) if wrapped else text
    if _RAISED in inner:
        message = inner.rsplit(_RAISED, 1)[1].strip()
        head = message.splitlines()[0][:40] if message else ""
        kind = ""
        for line in inner.splitlines():
            m = re.match(r"\s*([A-Za-z_][\w.]*): (.*)", line)
            if (
                m
                and head
                and m.group(2).startswith(head)
                and "ClientAppException" not in m.group(1)
            ):
                kind = m.group(1).rsplit(".", 1)[-1]
                break
        inner = message
    cause = " ".join(inner.split())
    cause = f"{kind}: {cause}" if kind and not cause.startswith(kind) else cause
    return cause[:CAUSE_CHARS]


def is_number(v: object) -> bool:
    """An int or float, not a bool (a client's ``True`` is not a count)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)
