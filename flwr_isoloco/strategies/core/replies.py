"""A reply's one path: a raw Flower reply Message becomes a checked, decoded update
(:class:`CheckedReply`) or a named rejection (:class:`Rejection`: the node and the reason).

Every strategy takes its replies through :class:`ReplyValidator`: DiLoCo/IsoLoCo one reply at
a time as it arrives (:meth:`ReplyValidator.check`), the graph strategies and federated
evaluation a round's list at once (:meth:`ReplyValidator.validate`). Flower's FedAvg raises
``InconsistentMessageReplies`` on one malformed reply and the run dies; here each reply is
checked on its own, a bad one is dropped with a logged reason naming the node and counted in
the round's :class:`ReplyReport`, and the round goes on with the rest. Nothing here raises on
a bad reply.

The checks, in order (the first failure drops the reply): error reply; no ArrayRecord under
``arrayrecord_key`` (a compressed record is decoded here, against the model's keys and shapes
first); keys that differ from the model; an array that does not decode, has the wrong shape or
a non-floating dtype (:func:`~.wire.decode_array`); another floating dtype (cast, or refused
with ``dtype_policy="reject"``); NaN / inf (:func:`~.wire.nonfinite_reason`); a missing or
invalid weight (``num-examples``: a finite number > 0); an ``inner-steps`` metric that is not
a count in ``[1, asked_steps]`` (:func:`steps_problem`); an invalid ``payload`` flag;
``||u_i||_2 > MAX_MERGEABLE_NORM`` (1e18, beyond which fp32 squares overflow); the optional
norm bounds; the repository's ``docs/strategies.md`` ("DiLoCo / IsoLoCo strategies"),
"What is rejected", gives the reasons.

Who sent a reply: the node the instruction went to (:class:`~.ledger.SentLedger`), else the
reply's ``src_node_id``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.logger import log

from flwr_isoloco.compression import decompress, is_compressed
from flwr_isoloco.merging.weights import norm_outlier
from flwr_isoloco.strategies.core.ledger import SentLedger, node_gone, not_this_round
from flwr_isoloco.strategies.core.metrics import tensor_norm
from flwr_isoloco.strategies.core.reply import (
    MAX_MERGEABLE_NORM,
    PAYLOAD_KEY,
    PAYLOADS,
    CheckedReply,
    Rejection,
    ReplyReport,
    array_digest,
    content_digest,
    is_number,
    node_error_cause,
    reply_metrics,
    reply_nbytes,
    steps_problem,
)
from flwr_isoloco.strategies.core.wire import decode_array, nonfinite_reason

__all__ = [
    "CheckedReply",
    "MAX_MERGEABLE_NORM",
    "PAYLOADS",
    "PAYLOAD_KEY",
    "Rejection",
    "ReplyReport",
    "ReplyValidator",
    "array_digest",
    "content_digest",
    "reply_metrics",
    "reply_nbytes",
    "steps_problem",
]

DTYPE_POLICIES = ("cast", "reject")

Spec = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def _np(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def _spec(tensors: Mapping[str, torch.Tensor] | None) -> Spec | None:
    return None if tensors is None else {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}


@dataclass
class ReplyValidator:
    """Validate Flower replies against an expected model; drop and log the bad ones.

    Parameters
    ----------
    arrayrecord_key, weighted_by_key :
        As in FedAvg.
    require_arrays :
        Train replies must carry arrays; evaluate replies need not.
    require_weight :
        Whether the weight key must be present (and a finite number > 0).
    dtype_policy :
        ``"cast"`` (default): a floating array of another floating dtype is cast to the expected
        dtype; ``"reject"``: dropped. Non-floating arrays for a floating model are always dropped.
    max_update_norm :
        Drop a reply whose update norm ``||u_i||_2`` (all tensors together) exceeds this.
    max_norm_ratio :
        Drop a reply whose update norm exceeds ``max_norm_ratio * median`` of the norms of the
        other accepted replies (applied when at least 2 others exist).
    default_payload :
        ``"weights"`` (FedAvg-style, ``u_i = theta - theta_i``) or ``"delta"`` (``u_i`` sent).
    what :
        Label used in log lines (e.g. ``"aggregate_train"``).
    asked_steps :
        The ``local-steps`` the train config asked for (None: unknown); a reply's
        ``inner-steps`` is checked against it (:func:`steps_problem`).
    """

    arrayrecord_key: str = "arrays"
    weighted_by_key: str = "num-examples"
    require_arrays: bool = True
    require_weight: bool = True
    dtype_policy: str = "cast"
    max_update_norm: float | None = None
    max_norm_ratio: float | None = None
    default_payload: str = "weights"
    what: str = "aggregate_train"
    asked_steps: int | None = None

    def __post_init__(self) -> None:
        if self.dtype_policy not in DTYPE_POLICIES:
            raise ValueError(
                f"dtype_policy must be one of {DTYPE_POLICIES}, got {self.dtype_policy!r}"
            )
        if self.default_payload not in PAYLOADS:
            raise ValueError(
                f"default_payload must be one of {PAYLOADS}, got {self.default_payload!r}"
            )
        for name in ("max_update_norm", "max_norm_ratio"):
            v = getattr(self, name)
            if v is not None and not (is_number(v) and v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number > 0 or None, got {v!r}")

    # ----------------------------------------------------------------- public
    def check(
        self,
        msg: Message,
        expected: Mapping[str, torch.Tensor] | None,
        ledger: SentLedger | None,
        report: ReplyReport,
    ) -> CheckedReply | Rejection:
        """One reply as it arrives: the checked reply (its tensors decoded once and cached,
        ``digest`` set), or its :class:`Rejection` (also logged and in ``report``).
        ``max_update_norm`` is applied here; ``max_norm_ratio`` needs the round's other norms
        (:meth:`norm_filter`). Never raises."""
        node = _sender(msg, ledger)
        result = self._checked(msg, node, _spec(expected), expected, report)
        if isinstance(result, Rejection):
            return result
        result.digest = content_digest(msg)
        bound = self.max_update_norm
        if bound is not None and expected is not None and result.update_norm > bound:
            result.release()
            return self.reject(
                report, node, f"update norm {result.update_norm:.4g} > max_update_norm {bound:.4g}"
            )
        return result

    def validate(
        self,
        replies: Iterable[Message],
        expected: Mapping[str, torch.Tensor] | None = None,
        ledger: SentLedger | None = None,
        log_summary: bool = True,
    ) -> tuple[list[CheckedReply], ReplyReport]:
        """Check every reply; return the usable ones (:func:`content_digest` order) and a report.

        ``expected`` is the model the replies must match (keys, shapes, dtypes) and the
        reference for ``u_i = theta - theta_i``. Without it only the structure is checked
        and the first good reply's keys/shapes become the reference for the others.
        Returned replies decode their arrays lazily (:meth:`CheckedReply.tensors`). Never raises.
        """
        replies = list(replies)
        report = ReplyReport()
        spec = _spec(expected)
        bounds = self.require_arrays and bool(self.max_update_norm or self.max_norm_ratio)
        checked: list[tuple[CheckedReply, float]] = []
        seen: set[str] = set()
        for msg in sorted(replies, key=lambda m: (content_digest(m), _sender(m, ledger))):
            why = not_this_round(msg, ledger, seen)
            if why:
                self.reject(report, _sender(msg, ledger), why)
                continue
            reply = self._checked(msg, _sender(msg, ledger), spec, expected, report)
            if isinstance(reply, Rejection):
                continue
            if spec is None and self.require_arrays:
                spec = _spec(reply.tensors())
            if expected is not None:
                norm = reply.update_norm
            else:
                norm = tensor_norm(reply.update(None)) if bounds else 0.0
            reply.release()
            checked.append((reply, norm))
        if ledger is not None:
            self.count_missing(ledger.missing(replies), report)
        kept = self._norm_filter(checked, report) if bounds else [r for r, _ in checked]
        report.used = len(kept)
        if log_summary:
            self.log_summary(report)
        return kept, report

    def norm_filter(self, replies: list[CheckedReply], report: ReplyReport) -> list[CheckedReply]:
        """The replies that pass the norm bounds (against each other's ``update_norm``)."""
        return self._norm_filter([(r, r.update_norm) for r in replies], report)

    def count_missing(self, nodes: Iterable[int], report: ReplyReport) -> None:
        """Count and log the nodes that sent no reply at all."""
        for node in nodes:
            report.missing += 1
            log(WARNING, "%s: no reply from node %d when the round closed", self.what, node)

    def log_summary(self, report: ReplyReport, server_round: int | None = None) -> None:
        """One line with the round's final counts (they agree with the round's metrics)."""
        where = self.what if server_round is None else f"{self.what} (round {server_round})"
        log(
            INFO,
            "%s: %d replies used, %d rejected, %d missing",
            where,
            report.used,
            report.rejected,
            report.missing,
        )

    def reject(self, report: ReplyReport, node: int, reason: str) -> Rejection:
        """Count ``node``'s reply as rejected and log why (also for callers that drop later)."""
        rejection = Rejection(node, reason)
        report.rejected += 1
        report.reasons.append(rejection)
        log(WARNING, "%s: dropped reply from node %d: %s", self.what, node, reason)
        return rejection

    def lose(self, report: ReplyReport, node: int, reason: str) -> Rejection:
        """Count ``node`` as lost (gone, not late nor hostile) and log why; its error reply is
        dropped as any error reply is, so ``replies-lost`` is a part of ``replies-rejected``."""
        report.lost += 1
        log(WARNING, "%s: lost node %d (the node is gone): %s", self.what, node, reason)
        return self.reject(report, node, reason)

    # ----------------------------------------------------------------- internals
    def _checked(
        self,
        msg: Message,
        node: int,
        spec: Spec | None,
        expected: Mapping[str, torch.Tensor] | None,
        report: ReplyReport,
    ) -> CheckedReply | Rejection:
        """Structure, values and the mergeable-norm limit of one reply."""
        report.bytes_up += reply_nbytes(msg)
        try:
            result = self._structure(msg, node, spec)
        except Exception as exc:  # noqa: BLE001 - never let one reply kill the round
            result = f"could not be read ({type(exc).__name__}: {exc})"
        if isinstance(result, str):
            if node_gone(msg):
                return self.lose(report, node, result)
            return self.reject(report, node, result)
        if expected is not None and self.require_arrays:
            result.update_norm = tensor_norm(result.update(expected))
            if not result.update_norm <= MAX_MERGEABLE_NORM:
                result.release()
                return self.reject(
                    report,
                    node,
                    f"update norm {result.update_norm:.3g} exceeds {MAX_MERGEABLE_NORM:.0e}, "
                    "the largest an fp32 merge can represent",
                )
        return result

    def _structure(self, msg: Message, node: int, spec: Spec | None) -> CheckedReply | str:
        """The reply's arrays (decoded, dtype policy applied), weight and payload, or why not."""
        if msg.has_error():
            return f"error reply (code {msg.error.code}): {node_error_cause(msg.error.reason)}"
        if not msg.has_content():
            return "reply has no content"
        content = msg.content
        decoded: dict[str, torch.Tensor] = {}
        if self.require_arrays:
            arrays = self._arrays(content, node, spec)
            if isinstance(arrays, str):
                return arrays
            decoded = arrays
        weight = 1.0
        if self.require_weight:
            w = None
            for mrec in content.metric_records.values():
                if self.weighted_by_key in mrec:
                    w = mrec[self.weighted_by_key]
                    break
            if w is None:
                return f"missing weight key {self.weighted_by_key!r} in its MetricRecord"
            if not is_number(w) or not math.isfinite(float(w)) or float(w) <= 0:
                return f"invalid weight {self.weighted_by_key!r}={w!r} (need a finite number > 0)"
            weight = float(w)
        if self.require_arrays and (why := steps_problem(content, self.asked_steps)):
            return why
        payload = self.default_payload
        for crec in content.config_records.values():
            if isinstance(crec, ConfigRecord) and PAYLOAD_KEY in crec:
                payload = crec[PAYLOAD_KEY]
                break
        if payload not in PAYLOADS:
            return f"invalid {PAYLOAD_KEY!r} flag {payload!r} (expected one of {PAYLOADS})"
        return CheckedReply(
            node,
            weight,
            reply_metrics(content),
            str(payload),
            content,
            self.arrayrecord_key,
            {k: t.dtype for k, t in decoded.items()},
            decoded if self.require_arrays else None,
        )

    def _arrays(
        self, content: RecordDict, node: int, spec: Spec | None
    ) -> dict[str, torch.Tensor] | str:
        """The record under ``arrayrecord_key`` decoded (a compressed one first), or why not."""
        rec = content.array_records.get(self.arrayrecord_key)
        if not isinstance(rec, ArrayRecord):
            found = sorted(content.array_records.keys())
            return f"no ArrayRecord under key {self.arrayrecord_key!r} (found {found})"
        if is_compressed(rec):
            try:
                shapes = None if spec is None else {k: v[0] for k, v in spec.items()}
                rec = {k: _np(t) for k, t in decompress(rec, shapes=shapes).items()}
            except ValueError as exc:
                return f"compressed record does not decode: {exc}"
        if spec is not None:
            missing = sorted(set(spec) - set(rec.keys()))
            extra = sorted(set(rec.keys()) - set(spec))
            if missing or extra:
                return f"array keys differ from the model: missing {missing[:5]}, extra {extra[:5]}"
        decoded: dict[str, torch.Tensor] = {}
        casts: list[str] = []
        for key, arr in rec.items():
            t = self._decode(key, arr, spec, casts)
            if isinstance(t, str):
                return t
            decoded[key] = t
        if casts:
            log(INFO, "%s: node %d: cast %d arrays (%s)", self.what, node, len(casts), casts[0])
        return decoded

    def _decode(self, key: str, arr, spec: Spec | None, casts: list[str]) -> torch.Tensor | str:
        """:func:`~.wire.decode_array`, the dtype policy, then :func:`~.wire.nonfinite_reason`
        (after a cast: fp64 values may overflow fp32)."""
        want = None if spec is None else spec.get(key)
        t = decode_array(key, arr, None if want is None else want[0])
        if isinstance(t, str):
            return t
        if want is not None and t.dtype != want[1]:
            if not (t.dtype.is_floating_point and want[1].is_floating_point):
                return f"array {key!r} has dtype {t.dtype}, expected {want[1]}"
            if self.dtype_policy == "reject":
                return (
                    f"array {key!r} has dtype {t.dtype}, expected {want[1]} (dtype_policy='reject')"
                )
            casts.append(f"{key}: {t.dtype}->{want[1]}")
            t = t.to(want[1])
        return nonfinite_reason(key, t) or t

    def _norm_filter(
        self, checked: list[tuple[CheckedReply, float]], report: ReplyReport
    ) -> list[CheckedReply]:
        norms = [n for _, n in checked]
        replies = [r for r, _ in checked]
        keep = [True] * len(checked)
        for i, (r, n) in enumerate(zip(replies, norms, strict=True)):
            if self.max_update_norm is not None and n > self.max_update_norm:
                keep[i] = False
                self.reject(
                    report,
                    r.node_id,
                    f"update norm {n:.4g} > max_update_norm {self.max_update_norm:.4g}",
                )
        if self.max_norm_ratio is not None:
            base = [n for n, k in zip(norms, keep, strict=True) if k]
            for i, (r, n) in enumerate(zip(replies, norms, strict=True)):
                if not keep[i]:
                    continue
                others = list(base)
                others.remove(n)
                reason = norm_outlier(n, others, self.max_norm_ratio, min_reference=2)
                if reason is not None:
                    keep[i] = False
                    self.reject(report, r.node_id, reason)
        return [r for r, k in zip(replies, keep, strict=True) if k]


def _sender(msg: Message, ledger: SentLedger | None) -> int:
    return ledger.sender(msg) if ledger is not None else msg.metadata.src_node_id
